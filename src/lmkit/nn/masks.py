"""Attention masks as additive biases: 0 where a query may look, the dtype's minimum where not.

Causal: query i sees keys j <= i + past; with a sliding window W also only j > i + past - W (transformers'
sliding-window mask). Padding: no query sees a padded key. A query row that can
see nothing (a left-padding position) gets a uniform row instead of NaN, as transformers does.
"""
from __future__ import annotations

import torch


def allowed_positions(attention_mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, causal: bool,
                      device: torch.device, window: int | None = None) -> torch.Tensor | None:
    """Boolean (B, 1, q_len, k_len): True where query i may attend to key j; None if all may."""
    allowed = None
    windowed = causal and window is not None and k_len > window
    if causal and not (q_len == 1) or windowed:
        past = k_len - q_len
        q = torch.arange(q_len, device=device)[:, None] + past
        k = torch.arange(k_len, device=device)[None, :]
        allowed = (k <= q) & (k > q - window) if windowed else k <= q
        allowed = allowed[None, None]
    if attention_mask is not None and not bool(attention_mask.all()):
        keys = attention_mask[:, None, None, :k_len].bool()
        allowed = keys if allowed is None else allowed & keys
    if allowed is not None:
        allowed = allowed.expand(batch, 1, q_len, k_len)
    return allowed


def additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """0 where allowed, finfo(dtype).min elsewhere; rows with nothing allowed become all zeros."""
    if allowed is None:
        return None
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask


def build_attention_bias(attention_mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, causal: bool,
                         dtype: torch.dtype, device: torch.device,
                         window: int | None = None) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for scaled_dot_product_attention: a boolean mask (True = may attend), as
    transformers passes it, so rows that see nothing come out as SDPA makes them; is_causal lets SDPA
    build a plain causal mask itself. A 4-D (B, 1, q_len, k_len) mask is taken as already prepared and used as
    given, as transformers does: boolean or 0/1 (True = may attend), or floating point (an additive bias)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        prepared = attention_mask.to(dtype) if attention_mask.is_floating_point() else attention_mask.bool()
        return prepared.to(device), False
    padded = attention_mask is not None and not bool(attention_mask[:, :k_len].all())
    if causal and not padded and q_len == k_len and (window is None or k_len <= window):
        return None, True
    return allowed_positions(attention_mask, batch, q_len, k_len, causal, device, window), False
