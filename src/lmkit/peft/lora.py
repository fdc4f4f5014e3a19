"""LoRA: y = W x + (alpha / r) B A x on chosen linear layers, W frozen (Hu et al. 2021).

A (r, in) starts Kaiming-uniform and B (out, r) at zero, so the adapted model starts equal to the
base. `merge` adds (alpha / r) B A into W (outputs unchanged, no extra cost); `unmerge` subtracts it.
The base may be a `QuantizedLinear` (QLoRA): then merging yields a dequantized full-precision layer.
Where the Hugging Face weights fuse several lmkit layers (GPT-2's c_attn = q, k, v) and the target names
that fused module, the parts share one A and each keeps its rows of B: one rank-r LoRA on the fused
layer, as PEFT builds it (same parameters, same count).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from lmkit.errors import ConfigError
from lmkit.peft.names import (WrappedLinear, find_modules, hf_groups, hf_names, matches, replace_module,
                              untie_shared_bases)
from lmkit.peft.quant import QuantizedLinear


# HF names of the heads that target_modules="all-linear" leaves out, as PEFT does (output embeddings; the
# classifier of sequence classification)
ALL_LINEAR_EXCLUDED = ("lm_head", "lm_head.decoder", "cls.predictions.decoder", "classifier", "score")


class LoRALinear(WrappedLinear):
    """A frozen `base_layer` plus the low-rank update (alpha / r) B A; names follow the PEFT library."""

    def __init__(self, base_layer: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 use_rslora: bool = False, lora_A: nn.Linear | None = None):
        """`lora_A`: an A shared with the other parts of a fused HF layer (then r is its rank)."""
        super().__init__()
        if r <= 0:
            raise ConfigError(f"LoRA rank r must be positive, got {r}")
        self.base_layer = base_layer
        self.r, self.alpha = r, alpha
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r   # rsLoRA: alpha / sqrt(r)
        weight = base_layer.weight
        own = lora_A is None
        if own:
            lora_A = nn.Linear(base_layer.in_features, r, bias=False, device=weight.device, dtype=weight.dtype)
        elif lora_A.weight.shape != (r, base_layer.in_features):
            raise ValueError(f"shared lora_A {tuple(lora_A.weight.shape)} does not fit rank {r}, "
                             f"{base_layer.in_features} inputs")
        self.lora_A = lora_A
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        if own:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A, shaped like W."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.merged:
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        if isinstance(self.base_layer, QuantizedLinear):
            raise ConfigError("cannot merge LoRA into a quantized base in place; use merge_and_unload(), which "
                              "returns full-precision layers")
        self.base_layer.weight += self.delta_weight().to(self.base_layer.weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        self.base_layer.weight -= self.delta_weight().to(self.base_layer.weight.dtype)
        self.merged = False

    @torch.no_grad()
    def merged_linear(self) -> nn.Linear:
        """A plain nn.Linear holding W + (alpha / r) B A (dequantized first when the base is quantized)."""
        base = self.base_layer
        w = base.weight.detach().float()
        if not self.merged:
            w = w + self.delta_weight().float()
        out = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None, device=w.device)
        dtype = self.lora_A.weight.dtype
        out.weight.copy_(w)
        if base.bias is not None:
            out.bias.copy_(base.bias)
        return out.to(dtype)


def apply_lora(model: nn.Module, target_modules, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               use_rslora: bool = False) -> list[str]:
    """Wrap every linear layer that matches `target_modules` in a LoRALinear; the names wrapped."""
    if target_modules == "all-linear":  # PEFT's shorthand: every linear layer but the output / classifier head
        hf = hf_names(model)
        names = [n for n in find_modules(model, "re:.*", (nn.Linear, QuantizedLinear))
                 if n != "lm_head" and hf.get(n, n) not in ALL_LINEAR_EXCLUDED]
    else:
        names = find_modules(model, target_modules, (nn.Linear, QuantizedLinear))
    if not names:
        raise ConfigError(f"no linear layer matches target_modules={target_modules!r}; use names such as q_proj, "
                          "v_proj (or the Hugging Face names of the model's family)")
    shared = fused_parts(model, names, lambda hf: target_modules == "all-linear" or matches(hf, target_modules))
    for name in names:
        first = model.get_submodule(shared[name][0]) if name in shared and shared[name][0] != name else None
        replace_module(model, name, LoRALinear(model.get_submodule(name), r, alpha, dropout, use_rslora,
                                               lora_A=first.lora_A if first is not None else None))
    return names


def fused_parts(model: nn.Module, names: list[str], targeted) -> dict[str, list[str]]:
    """lmkit name -> all parts of its fused HF layer, for the layers adapted as one (`targeted(hf_name)`, every
    part chosen, one input size): these share one A."""
    chosen, out = set(names), {}
    for hf, parts in hf_groups(model).items():
        if len(parts) > 1 and chosen.issuperset(parts) and targeted(hf) and \
                len({model.get_submodule(p).in_features for p in parts}) == 1:
            out.update({p: parts for p in parts})
    return out


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> None:
    untie_shared_bases(model, [m for m in lora_layers(model).values() if not m.merged])
    for m in lora_layers(model).values():
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_layers(model).values():
        m.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace each LoRALinear by a plain linear layer holding W + (alpha / r) B A; returns the model."""
    untie_shared_bases(model, [m for m in lora_layers(model).values() if not m.merged])
    for name, m in lora_layers(model).items():
        replace_module(model, name, m.merged_linear())
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block every unmerged LoRALinear answers as its base layer alone (PEFT's `disable_adapter`):
    the base model, with no second copy held (DPO's reference under LoRA)."""
    layers = [m for m in lora_layers(model).values() if not m.merged]
    for m in layers:
        m.merged = True  # the forward then skips the low-rank branch; W itself holds no merged update
    try:
        yield model
    finally:
        for m in layers:
            m.merged = False
