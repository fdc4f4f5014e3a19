"""Post-training dynamic int8 quantization of linear layers, for CPU inference.

Weights are stored as int8 with one scale per tensor (w ~ s q); at run time each activation batch
is quantized with its own range, multiplied in int8 with int32 accumulation (fbgemm / onednn) and
rescaled: y ~ s_x s_w (q_x q_w^T) + b. Embeddings, norms and a tied LM head stay in float32.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose nn.Linear layers (except an LM head tied to the embeddings) are int8."""
    q = copy.deepcopy(model).float().eval()
    tied = {id(p) for m in q.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    skip = {name for name, m in q.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in tied}
    spec = {name for name, m in q.named_modules() if isinstance(m, nn.Linear) and name not in skip}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor types as deprecated; they still run
        return torch.ao.quantization.quantize_dynamic(q, spec, dtype=torch.qint8)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: float tensors at their size, int8 weights one byte each."""
    total, seen = 0, set()
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "_packed_params") and hasattr(module, "weight"):
            w = module.weight()
            total += w.numel() + 8  # int8 values plus scale and zero point
            b = module.bias()
            total += 0 if b is None else b.numel() * b.element_size()
            continue
        for p in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
