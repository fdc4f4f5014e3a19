"""Sparse attention in tiles with an online softmax: FlashAttention's algorithm over a block-sparse pattern, in
PyTorch ops (any device), forward and backward.

The queries are cut into tiles; a plan gives each tile its few key blocks (a slice of the sequence, or positions
gathered per row and head), each with the pairs it allows. Per tile, over its blocks: s = q k_b^T * scale (masked),
m' = max(m, rowmax s), l' = l e^(m - m') + rowsum e^(s - m'), acc' = acc e^(m - m') + e^(s - m') v_b; out = acc / l,
lse = m + ln l. The backward recomputes p = e^(s - lse) block by block: dv_b = p^T do, ds = p (do v_b^T -
rowsum(do * out)) * scale, dq += ds k_b, dk_b = ds^T q, scattered back to the block's positions. Only q, k, v, out
and lse are kept, and one tile's scores at a time: memory O(T) for a pattern with a bounded number of keys per query
(Longformer's window and global tokens, BigBird's blocks), never the n x n matrix nor the pattern's own scores. A
block listed twice counts twice (a softmax over a list of keys, as BigBird's repeated random blocks); a query that
sees no key gets 0.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class KeyBlock(NamedTuple):
    """Keys one query tile reads: `keys` a slice of positions, or positions (B or 1, H or 1, n) gathered; `allowed`
    (B or 1, H or 1, tq or 1, n) True where a query may see a key, None for every pair."""

    keys: slice | torch.Tensor
    allowed: torch.Tensor | None = None


Plan = Callable[[int, int], list[KeyBlock]]  # the queries [i0, i1) -> the key blocks they read


def _take(x: torch.Tensor, keys: slice | torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) at the block's positions: (B, H, n, D)."""
    if isinstance(keys, slice):
        return x[:, :, keys]
    B, H, _, D = x.shape
    return x.gather(2, keys.expand(B, H, keys.shape[-1])[..., None].expand(B, H, keys.shape[-1], D))


def _put(grad: torch.Tensor, keys: slice | torch.Tensor, part: torch.Tensor) -> None:
    """grad[:, :, keys] += part, positions listed twice adding twice."""
    if isinstance(keys, slice):
        grad[:, :, keys] += part
        return
    B, H, n, D = part.shape
    grad.scatter_add_(2, keys.expand(B, H, n)[..., None].expand(B, H, n, D), part)


def _scores(qt, kb, scale, allowed):
    s = torch.matmul(qt, kb.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


class BlockTiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, tiles, plan):
        wide = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        for i0, i1 in tiles:
            qt = q[:, :, i0:i1].to(wide)
            m = torch.full(qt.shape[:-1], float("-inf"), dtype=wide, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros_like(qt)
            for block in plan(i0, i1):
                s = _scores(qt, _take(k, block.keys).to(wide), scale, block.allowed)
                m_new = torch.maximum(m, s.amax(-1))
                base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows that saw nothing yet
                p = torch.exp(s - base[..., None])
                fix = torch.exp(m - base)
                l = l * fix + p.sum(-1)
                acc = acc * fix[..., None] + torch.matmul(p, _take(v, block.keys).to(wide))
                m = m_new
            seen = l > 0
            safe = torch.where(seen, l, torch.ones_like(l))
            out[:, :, i0:i1] = acc / safe[..., None]
            lse[:, :, i0:i1] = torch.where(seen, m + torch.log(safe), torch.full_like(m, float("-inf")))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (scale, tiles, plan)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        scale, tiles, plan = ctx.settings
        wide = lse.dtype
        delta = (do.to(wide) * out.to(wide)).sum(-1)  # rowsum(do * out)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # such rows saw no key: p = 0
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dk = torch.zeros(k.shape, dtype=wide, device=q.device)
        dv = torch.zeros(v.shape, dtype=wide, device=q.device)
        for i0, i1 in tiles:
            qt, dot = q[:, :, i0:i1].to(wide), do[:, :, i0:i1].to(wide)
            for block in plan(i0, i1):
                kb, vb = _take(k, block.keys).to(wide), _take(v, block.keys).to(wide)
                p = torch.exp(_scores(qt, kb, scale, block.allowed) - safe_lse[:, :, i0:i1, None])
                ds = p * (torch.matmul(dot, vb.transpose(-1, -2)) - delta[:, :, i0:i1, None]) * scale
                dq[:, :, i0:i1] += torch.matmul(ds, kb)
                _put(dk, block.keys, torch.matmul(ds.transpose(-1, -2), qt))
                _put(dv, block.keys, torch.matmul(p.transpose(-1, -2), dot))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def block_tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[int, int]],
                          plan: Plan, scale: float = 1.0) -> torch.Tensor:
    """softmax over each query's listed keys of q k^T * scale, times v: q (B, H, T, D), k and v (B, H, S, D); `tiles`
    the query ranges [i0, i1) to compute (rows outside them stay 0), `plan(i0, i1)` their key blocks."""
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"block tiles: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "(B, H, T, D) / (B, H, S, D)")
    return BlockTiles.apply(q, k, v, scale, tiles, plan)


def key_chunks(S: int, allowed: Callable[[int, int], torch.Tensor | None], size: int = 512) -> list[KeyBlock]:
    """Every key of [0, S) in slices of `size`, each with `allowed(j0, j1)`: a query that sees the whole sequence."""
    return [KeyBlock(slice(j0, min(j0 + size, S)), allowed(j0, min(j0 + size, S))) for j0 in range(0, S, size)]
