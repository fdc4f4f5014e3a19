"""Attention that never writes the n x n matrix: FlashAttention's tiling with an online softmax, in PyTorch ops
(any device), forward and backward.

Per query tile, over the key tiles it may see: s = q k^T * scale, m' = max(m, rowmax s), l' = l e^(m - m') +
rowsum e^(s - m'), acc' = acc e^(m - m') + e^(s - m') v; out = acc / l, lse = m + ln l. The backward recomputes
p = e^(s - lse) tile by tile: dv += p^T do, ds = p (do v^T - rowsum(do * out)), dq += ds k * scale,
dk += ds^T q * scale. Memory is O(T) (q, k, v, out, lse and one tile of scores), never O(T^2).

What a query may see is given structurally, never as a dense mask: causal (key j <= past + i, past = S - T),
a sliding window (past + i - j < window), key padding (B, S); n_kv_heads < n_heads shares each key/value head
among n_heads / n_kv_heads query heads (GQA). A query that sees no key gets 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

TILE = 512  # query rows and key columns per tile


def _visible(i0: int, i1: int, j0: int, j1: int, past: int, causal: bool, window: int | None) -> bool:
    """Whether any query of [i0, i1) may see a key of [j0, j1)."""
    if causal and j0 > past + i1 - 1:
        return False
    return window is None or past + i0 - (j1 - 1) < window


def _tile_mask(i0: int, i1: int, j0: int, j1: int, past: int, causal: bool, window: int | None,
               keep: torch.Tensor | None, device) -> torch.Tensor | None:
    """Allowed (B or 1, 1, 1, tq, tk) for the tile, or None when every pair is allowed (decided from the
    corners, so the tiles below the diagonal build no mask)."""
    allowed = None
    hides_causal = causal and j1 - 1 > past + i0
    hides_window = window is not None and past + i1 - 1 - j0 >= window
    if hides_causal or hides_window:
        qi = torch.arange(i0, i1, device=device)[:, None] + past
        kj = torch.arange(j0, j1, device=device)[None, :]
        allowed = kj <= qi if hides_causal else None
        if hides_window:
            allowed = (qi - kj < window) if allowed is None else allowed & (qi - kj < window)
    if keep is not None:
        pad = keep[:, None, None, None, j0:j1]
        allowed = pad if allowed is None else pad & allowed
    return allowed


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H_kv, H / H_kv, T, D): the query heads of each shared key/value head together."""
    B, H, T, D = q.shape
    return q.view(B, kv_heads, H // kv_heads, T, D)


def _scores(qt: torch.Tensor, kt: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(qt * scale, kt.unsqueeze(2).transpose(-1, -2))
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def _forward(q, k, v, scale, causal, window, keep, tile):
    B, H, T, D = q.shape
    S, G = k.shape[2], k.shape[1]
    past = S - T
    qg = _grouped(q, G)
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for i0 in range(0, T, tile):
        i1 = min(i0 + tile, T)
        qt = qg[:, :, :, i0:i1]
        m = torch.full(qt.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
        for j0 in range(0, S, tile):
            j1 = min(j0 + tile, S)
            if not _visible(i0, i1, j0, j1, past, causal, window):
                continue
            s = _scores(qt, k[:, :, j0:j1], scale, _tile_mask(i0, i1, j0, j1, past, causal, window, keep, q.device))
            s = s.float()
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows that saw nothing yet
            p = s.sub_(base[..., None]).exp_()
            fix = torch.exp(m - base)
            l = l.mul_(fix).add_(p.sum(-1))
            acc = acc.mul_(fix[..., None]).add_(torch.matmul(p.to(v.dtype), v[:, :, None, j0:j1]).float())
            m = m_new
        seen = l > 0
        out[:, :, :, i0:i1] = (acc / torch.where(seen, l, torch.ones_like(l))[..., None]).to(q.dtype)
        lse[:, :, :, i0:i1] = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), lse[:, :, :, i0:i1])
    return out.view(B, H, T, D), lse


def _backward(do, q, k, v, out, lse, scale, causal, window, keep, tile):
    B, H, T, D = q.shape
    S, G = k.shape[2], k.shape[1]
    past = S - T
    qg, dog, outg = _grouped(q, G), _grouped(do, G), _grouped(out, G)
    delta = (dog.float() * outg.float()).sum(-1)  # rowsum(do * out)
    dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    for j0 in range(0, S, tile):
        j1 = min(j0 + tile, S)
        kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]
        for i0 in range(0, T, tile):
            i1 = min(i0 + tile, T)
            if not _visible(i0, i1, j0, j1, past, causal, window):
                continue
            mask = _tile_mask(i0, i1, j0, j1, past, causal, window, keep, q.device)
            qt, dot = qg[:, :, :, i0:i1], dog[:, :, :, i0:i1]
            p = torch.exp(_scores(qt, kt, scale, mask).float() - safe_lse[:, :, :, i0:i1, None])  # masked: e^-inf = 0
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2).to(do.dtype), dot).sum(2).float()
            dp = torch.matmul(dot, vt.unsqueeze(2).transpose(-1, -2)).float()
            ds = p * (dp - delta[:, :, :, i0:i1, None]) * scale
            dq[:, :, :, i0:i1] += torch.matmul(ds.to(q.dtype), kt.unsqueeze(2)).float()
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2).to(q.dtype), qt).sum(2).float()
    return dq.view(B, H, T, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, keep, tile):
        out, lse = _forward(q, k, v, scale, causal, window, keep, tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (scale, causal, window, keep, tile)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(do.contiguous(), q, k, v, out, lse, *ctx.settings), None, None, None, None, None)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    key_padding_mask: torch.Tensor | None = None, window: int | None = None,
                    scale: float | None = None, tile: int = TILE) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, H, T, D) and k, v (B, H_kv, S, D), S >= T (the queries are the
    last T positions), in O(T) memory; `key_padding_mask` (B, S): 1/True for keys that count."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or k.shape[2] < q.shape[2]:
        raise ValueError(f"tiled attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "(B, H, T, D) / (B, H_kv, S, D) with H a multiple of H_kv and S >= T")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.bool)
    return TiledAttention.apply(q, k, v, scale, causal, window, keep, tile)


class StructuredMask(NamedTuple):
    """What the queries of a self-attention call may see, without the dense (B, 1, T, S) mask: causal or not,
    a sliding window, and the keys that count (B, S) or None. `Stack` passes it for long masked inputs
    (`DENSE_MASK_LIMIT`); `Attention` attends with `tiled_attention` on it, or spells it out where it must."""

    causal: bool
    window: int | None
    keep: torch.Tensor | None

    def dense(self, batch: int, q_len: int, k_len: int, device) -> torch.Tensor:
        """The boolean (B, 1, q_len, k_len) mask it stands for (True: may attend)."""
        past = k_len - q_len
        qi = torch.arange(q_len, device=device)[:, None] + past
        kj = torch.arange(k_len, device=device)[None, :]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= kj <= qi
        if self.window is not None:
            allowed &= qi - kj < self.window
        allowed = allowed[None, None]
        if self.keep is not None:
            allowed = allowed & self.keep[:, None, None, :k_len].to(device=device, dtype=torch.bool)
        return allowed.expand(batch, 1, q_len, k_len)


# mask elements (B x T x S) past which a self-attention with padding or a window attends through the tiles
# instead of a dense mask: 64M, a 64 MB boolean mask that SDPA would also widen to the scores' dtype
DENSE_MASK_LIMIT = 1 << 26
