"""Extending a RoPE decoder's window for fine-tuning at a longer length, as transformers' `rope_scaling` defines it.

Position interpolation (Chen et al. 2023, `linear`): theta_m / F, so positions 0..F L fall on the angles that
0..L had. NTK-aware (`dynamic`): the base grows to theta (F n / L - (F - 1))^(d / (d - 2)) once a forward's
n positions outrun the trained L. YaRN (Peng et al. 2023, `yarn`): theta_m / F only for the dimensions that turn
fewer than beta_slow times over L, unchanged past beta_fast turns, a ramp between, and cos/sin times
0.1 ln F + 1.
"""
from __future__ import annotations

import math

from torch import nn

from lmkit.errors import ConfigError
from lmkit.nn import RotaryEmbedding

ROPE_EXTENSIONS = ("linear", "dynamic", "yarn")


def rope_extension(config, kind: str, factor: float | None, seq_len: int | None) -> tuple[int, int, dict]:
    """(rows' length, new max_seq_len, rope_scaling) that extend `config`'s window of L positions by `kind`:
    factor F (default seq_len / L) and the length trained at (default F L). max_position_embeddings becomes the
    new length, except for `dynamic`, whose base grows only past max_position_embeddings in transformers, so it
    keeps L there (and the rows may run past it)."""
    if kind not in ROPE_EXTENSIONS:
        raise ConfigError(f"--rope-scaling must be one of {', '.join(ROPE_EXTENSIONS)}, got {kind!r}")
    if config.position != "rope":
        raise ConfigError(f"--rope-scaling extends a RoPE model's window; this model has {config.position} positions "
                          "(fine-tune it at its own length: drop --rope-scaling)")
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ConfigError(f"the model's RoPE is already scaled ({scaling.get('rope_type', scaling.get('type'))}); "
                          "extend the model it was made from, or fine-tune this one without --rope-scaling")
    old = config.max_seq_len
    if factor is None and seq_len is None:
        raise ConfigError("--rope-scaling needs --rope-factor F or --seq-len N (the new length; F = N / the "
                          f"model's {old} positions)")
    if factor is not None and not (1.0 <= factor < math.inf):
        raise ConfigError(f"--rope-factor must be at least 1 (how many times the window grows), got {factor}")
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {seq_len}")
    factor = float(factor if factor is not None else max(seq_len / old, 1.0))
    seq_len = seq_len if seq_len is not None else round(old * factor)
    rope = {"rope_type": kind, "factor": factor}
    if kind == "yarn":  # the one of the three that reads it (transformers warns of it in the others)
        rope["original_max_position_embeddings"] = old
    return seq_len, (old if kind == "dynamic" else max(seq_len, old)), rope


def extend_window(model: nn.Module, kind: str, factor: float | None, seq_len: int | None) -> int:
    """Give `model` (a CausalLM, before any PEFT method) the extended RoPE in place; the length to train at."""
    seq_len, max_seq_len, rope = rope_extension(model.config, kind, factor, seq_len)
    model.config.rope_scaling, model.config.max_seq_len = rope, max_seq_len  # every module shares this config
    stack = model.decoder
    stack.rotary = RotaryEmbedding(model.config).to(stack.rotary.inv_freq.device)
    return seq_len
