"""Shifted sparse attention (S2-Attn, LongLoRA: Chen et al. 2023), the causal attention LongLoRA fine-tunes with.

The T positions are cut into groups of G; each query attends causally within its group only. Half the heads see
the sequence shifted by G/2 first, so their groups straddle two neighbouring groups of the other half and
information flows between groups across layers. Cost: T G scores instead of T^2 / 2. Causality is kept by
position: the shifted half's last group wraps around to the start, where a key counts only if it does not
come after its query (the paper's code lets the first tokens see the last ones there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkit.errors import ConfigError


def check_group(length: int, group: int) -> None:
    """Refuse a group size that cannot serve rows of `length` tokens."""
    if group < 2 or group % 2:
        raise ConfigError(f"the S2-Attn group size must be an even number of at least 2 (half of it is the shift), "
                          f"got {group}; pass --s2-group G")
    if length % group:
        raise ConfigError(f"rows of {length} tokens do not split into S2-Attn groups of {group}; use a --seq-len that "
                          f"is a multiple of {group} or another --s2-group")


def _shift(x: torch.Tensor, half: int, by: int) -> torch.Tensor:
    """Roll the heads from `half` on by `by` positions along the sequence (dim 2)."""
    return torch.cat((x[:, :half], x[:, half:].roll(by, dims=2)), dim=1)


def shifted_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int,
                             scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """S2-Attn of q (B, H, T, D) over k, v (B, H_kv, T, D) (GQA: H a multiple of H_kv) in causal groups of
    `group`; (B, H, T, D). Heads H/2.. run on the sequence rolled back by group/2, and their output is rolled
    forward again."""
    B, H, T, D = q.shape
    check_group(T, group)
    if k.shape[1] != H:
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    half, n = H // 2, T // group
    pos = torch.arange(T, device=q.device)
    pos = torch.stack((pos, pos.roll(-(group // 2))))[(torch.arange(H, device=q.device) >= half).long()]
    pos = pos.view(H, n, group)
    allowed = pos[:, :, None, :] <= pos[:, :, :, None]  # (H, n, G queries, G keys): causal by true position

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return _shift(x, half, -(group // 2)).reshape(B, H, n, group, D)

    out = F.scaled_dot_product_attention(grouped(q), grouped(k), grouped(v), attn_mask=allowed[None],
                                         dropout_p=dropout, scale=scale)
    return _shift(out.reshape(B, H, T, D), half, group // 2)
