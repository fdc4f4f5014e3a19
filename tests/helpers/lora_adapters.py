"""LoRA adapter folders with random A and B (a trained-from-scratch B is zero: the adapter would change nothing)."""
import copy

import torch

from lmkit.peft import get_peft_model, load_adapter, merge_and_unload, save_adapter


def make_adapter(model, folder, seed: int, targets):
    """Write a rank-4 LoRA of `model` on `targets` to `folder`; returns the merged model (W + s B A) it equals."""
    peft = get_peft_model(copy.deepcopy(model), "lora", r=4, alpha=8, target_modules=targets)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_adapter(peft, folder)
    return merge_and_unload(load_adapter(copy.deepcopy(model), folder).base_model)
