"""AdamW's two parameter groups: weight decay on the weight matrices of linear layers only; biases, norm gains and
embedding tables (with the LM head tied to them) are left undecayed."""
from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float, skip: set[int] = frozenset()) -> list[dict]:
    """[{params: decayed, weight_decay}, {params: not decayed, weight_decay: 0}], each parameter once
    (but those whose id() is in `skip`)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            no_decay.add(id(module.weight))
    decay, keep, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        # ndim < 2: biases and norm gains; embeddings are matrices, so they are named above
        (keep if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
