"""Module names: lmkit's (`decoder.layers.0.self_attn.sublayer.q_proj`) and the Hugging Face ones
(`model.layers.0.self_attn.q_proj`) the family's weight table maps them to.

Target patterns match either name: a plain string matches the last components
(`q_proj`, `attn.c_attn`), a string starting with `re:` is a regular expression matched in full.
"""
from __future__ import annotations

import re

from torch import nn

from lmkit.hub import _families
from lmkit.hub.convert import rename

# parameter names that belong to the methods (trainable); everything else is frozen
ADAPTER_PARAMS = ("lora_A", "lora_B", "prefix_keys", "prefix_values", "prompt_embeddings", "adapter_down",
                  "adapter_up", "ia3_l")


def hf_groups(model: nn.Module) -> dict[str, list[str]]:
    """HF module name -> the lmkit modules whose weights it holds, in row order (GPT-2's c_attn: q, k, v).

    Empty when the model has no Hugging Face family (lmkit's own format): names stay lmkit's.
    """
    config = getattr(model, "config", None)
    family = getattr(config, "family", None)
    if not family:
        return {}

    module = _families().get(family)
    if module is None:
        return {}
    rules = module.rules(config)
    groups: dict[str, list[str]] = {}
    for rule in rules:
        if rule.hf.endswith(".weight") and all(o.endswith(".weight") for o in rule.ours):
            groups[rule.hf.removesuffix(".weight")] = [o.removesuffix(".weight") for o in rule.ours]
    return groups


def hf_names(model: nn.Module) -> dict[str, str]:
    """lmkit module name -> HF module name (identity where the model has no family)."""
    out = {}
    for hf, parts in hf_groups(model).items():
        for p in parts:
            out[p] = hf
    return out


def matches(name: str, patterns, other: str | None = None) -> bool:
    """Whether module `name` (or its HF name `other`) matches one of `patterns`."""
    if isinstance(patterns, str):
        patterns = [patterns]
    for pattern in patterns:
        for candidate in (name, other):
            if candidate is None:
                continue
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], candidate):
                    return True
            elif candidate == pattern or candidate.endswith("." + pattern):
                return True
    return False


def find_modules(model: nn.Module, patterns, kinds: tuple[type, ...]) -> list[str]:
    """Names of the modules of the given kinds that match `patterns`."""
    names = hf_names(model)
    return [name for name, module in model.named_modules()
            if isinstance(module, kinds) and matches(name, patterns, names.get(name))]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def hf_rules(model: nn.Module) -> list:
    """The family's weight rules (lmkit tensors <-> one HF tensor); identity rules without a family."""
    config = getattr(model, "config", None)
    family = getattr(config, "family", None)
    module = _families().get(family) if family else None
    if module is None:
        return [rename(n, n) for n, _ in model.named_parameters()]
    return module.rules(config)


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """{id(parameter): every name it has in `model`} (more than one for a head tied to the embedding)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


def own_copy(model: nn.Module, module: nn.Module, attr: str) -> None:
    """Give `module` its own copy of the parameter `attr` it shares; the model's config then says untied, so that a
    saved model keeps both (a trained or merged head apart from the embedding)."""
    p = getattr(module, attr)
    setattr(module, attr, nn.Parameter(p.detach().clone(), p.requires_grad))
    config = getattr(model, "config", None)
    if getattr(config, "tie_embeddings", False):
        model.config = config.replace(tie_embeddings=False)


def untie_shared_bases(model: nn.Module, layers) -> None:
    """Give each of `layers` (wrapped linear layers about to be merged) whose base weight is shared (a head tied
    to the embedding) its own copy (`own_copy`), so that merging changes that layer alone (merging into the
    shared weight would change the embedding too)."""
    owners = parameter_owners(model)
    for m in layers:
        w = m.base_layer.weight
        if isinstance(w, nn.Parameter) and len(owners.get(id(w), ())) > 1:
            own_copy(model, m.base_layer, "weight")


class WrappedLinear(nn.Module):
    """A module that stands in for a frozen linear `base_layer` and shows its weight and sizes."""

    base_layer: nn.Module

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features
