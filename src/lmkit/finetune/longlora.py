"""LongLoRA (Chen et al. 2023): fine-tune for a longer window with shifted sparse attention (S2-Attn, groups of
the rows with half the heads shifted by half a group: `lmkit.nn.shifted_attention`) while training only, and
LoRA plus trainable embeddings and norms ("LoRA+"); the model keeps full attention at inference, so what is
saved is a plain model or adapter.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from lmkit.errors import ConfigError
from lmkit.nn import Attention
from lmkit.nn.shifted_attention import check_group

# what LoRA+ trains in full beside the LoRA matrices, as PEFT matches modules_to_save (by the name's end):
# the token embeddings and every norm (input_layernorm, post_attention_layernorm, the final norm)
TRAINED_IN_FULL = ("embed_tokens", "norm")
METHODS = ("lora", "full")


def longlora_settings(method: str, settings: dict) -> dict:
    """The PEFT settings with LoRA+'s embeddings and norms trained in full; a ConfigError for other methods."""
    if method not in METHODS:
        raise ConfigError(f"--longlora trains LoRA (or the full model) with S2-Attn; use --peft lora or full, "
                          f"not {method}")
    if method == "full":
        return settings
    saved = list(settings.get("modules_to_save") or [])
    return {**settings, "modules_to_save": saved + [m for m in TRAINED_IN_FULL if m not in saved]}


def group_size(seq_len: int, group: int | None) -> int:
    """The S2-Attn group size for rows of `seq_len` tokens: `group`, or a quarter of the row as the paper does."""
    group = group if group is not None else seq_len // 4
    check_group(seq_len, group)
    return group


@contextmanager
def shifted_attention(model: nn.Module, group: int):
    """Every self-attention of `model` runs S2-Attn in groups of `group` while training (eval mode stays full)
    within the block; afterwards no trace is left on the model."""
    layers = [m for m in model.modules() if isinstance(m, Attention) and not m.cross]
    for m in layers:
        m.s2_group = group
    try:
        yield
    finally:
        for m in layers:
            m.s2_group = None
