"""Attention probabilities of any lmkit model, read from its own attention layers.

Each `lmkit.nn.Attention` has an opt-in `keep_probabilities` switch: while it is on, the layer attends in
plain matrix products and keeps softmax(Q K^T * scale + mask) (B, H, T_q, T_k). `attention_maps` turns it on
for one forward pass and returns the maps by layer name, in the order the layers ran.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from lmkit.errors import ConfigError
from lmkit.nn.attention import Attention


def _label(name: str) -> str:
    """'decoder.layers.3.self_attn.sublayer' -> 'decoder 4 self'."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        stack = ".".join(parts[:i]) or "stack"
        kind = parts[i + 2].removesuffix("_attn") if len(parts) > i + 2 else "attn"
        return f"{stack} {int(parts[i + 1]) + 1} {kind}"
    return name


@contextmanager
def keeping_probabilities(model: torch.nn.Module) -> Iterator[list[tuple[str, Attention]]]:
    layers = [(_label(n), m) for n, m in model.named_modules() if isinstance(m, Attention)]
    if not layers:
        raise ConfigError("this model has no lmkit attention layers to read maps from")
    for _, m in layers:
        m.keep_probabilities, m.probabilities = True, None
    try:
        yield layers
    finally:
        for _, m in layers:
            m.keep_probabilities = False


def attention_maps(model: torch.nn.Module, input_ids: torch.Tensor, **inputs) -> dict[str, torch.Tensor]:
    """{layer label: probabilities (B, H, T_q, T_k)} of one forward pass on input_ids (and any other model inputs);
    an encoder-decoder model gets decoder_input_ids = [decoder start] + input_ids[:, :-1] unless given."""
    if hasattr(model, "encoder") and hasattr(model, "decoder") and "decoder_input_ids" not in inputs:
        start = getattr(model.config, "decoder_start_token_id", None)
        start = 0 if start is None else start
        inputs["decoder_input_ids"] = torch.cat(
            (torch.full_like(input_ids[:, :1], start), input_ids[:, :-1]), dim=1)
    with keeping_probabilities(model) as layers, torch.no_grad():
        model(input_ids, **inputs)
        return {label: m.probabilities for label, m in layers if m.probabilities is not None}
