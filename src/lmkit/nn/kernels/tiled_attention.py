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
import torch.nn.functional as F

TILE = 512  # query rows and key columns per tile of the PyTorch-ops path (a tile of scores at a time)
CPU_TILE = 2048  # query rows per call of ATen's CPU flash kernel (fewer, larger calls; it tiles inside)
_PORTABLE = False  # True: the PyTorch-ops tiles on CPU too (tests compare both)
# B x T x S at or below which `tiled_attention` (without an explicit tile) hands a masked call to SDPA with the
# mask spelled out (4M elements, 16 MB as float32: what one tile's mask holds): one fused call, no per-block
# masks or merging; measured faster than the tiles up to 4k x 4k on CPU (docs/long_context.md)
SDPA_LIMIT = 1 << 22
FUSED_SDPA_DEVICES = ("cpu", "cuda")  # where SDPA without a mask runs a fused kernel in O(T) memory


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


# On CPU, each query tile's key blocks go through ATen's fused flash kernel, which returns the log-sum-exp
# the blocks are merged with (the online softmax across blocks) and takes it back in the backward.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _key_blocks(i0: int, i1: int, S: int, past: int, causal: bool, window: int | None) -> list[tuple[int, int, str]]:
    """(j0, j1, kind) key blocks the queries [i0, i1) may see: "clean" where every query of the tile sees every
    key (no causal or window mask), "causal" for the square block on the diagonal that the kernel's own causal
    flag serves, "masked" for what needs a mask."""
    lo = max(0, past + i0 - window + 1) if window is not None else 0
    hi = min(S, past + i1) if causal else S
    if hi <= lo:
        return []
    diagonal = causal and hi == past + i1 and (window is None or i1 - i0 <= window)
    clean_lo = max(lo, past + i1 - window) if window is not None else lo
    clean_hi = min(hi, past + i0) if causal else hi
    if clean_hi <= clean_lo:
        return [(lo, hi, "causal" if diagonal and lo == past + i0 else "masked")]
    blocks = [(lo, clean_lo, "masked"), (clean_lo, clean_hi, "clean"),
              (clean_hi, hi, "causal" if diagonal else "masked")]
    return [(j0, j1, kind) for j0, j1, kind in blocks if j1 > j0]


def _block_bias(i0, i1, j0, j1, past, causal, window, keep, kind, dtype, device):
    """(additive mask (B or 1, 1, tq or 1, tk) or None, is_causal for the kernel, rows that see no key of the
    block (B or 1, 1, tq or 1, 1) or None); such rows are let see every key, and their result is dropped."""
    if kind == "causal" and keep is None:
        return None, True, None
    allowed = _tile_mask(i0, i1, j0, j1, past, causal, window, None, device) if kind != "clean" else None
    if allowed is not None:
        allowed = allowed[None, None]  # (1, 1, tq, tk)
    if keep is not None:
        pad = keep[:, None, None, j0:j1]
        allowed = pad if allowed is None else pad & allowed
    if allowed is None:
        return None, False, None
    empty = ~allowed.any(-1, keepdim=True)
    if bool(empty.any()):
        allowed = allowed | empty
    else:
        empty = None
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")), False, empty


def _cpu_forward(q, k, v, scale, causal, window, keep, tile):
    B, H, T, D = q.shape
    S, past = k.shape[2], k.shape[2] - q.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
    for i0 in range(0, T, tile):
        i1 = min(i0 + tile, T)
        m = l = acc = None
        for j0, j1, kind in _key_blocks(i0, i1, S, past, causal, window):
            bias, diagonal, empty = _block_bias(i0, i1, j0, j1, past, causal, window, keep, kind, q.dtype, q.device)
            o, b_lse = _FLASH_CPU(q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], is_causal=diagonal, attn_mask=bias,
                                  scale=scale)
            if empty is not None:
                b_lse = b_lse.masked_fill(empty[..., 0].expand_as(b_lse), float("-inf"))
            if m is None:
                m, l, acc = b_lse, torch.ones_like(b_lse), o.float()
                continue
            m_new = torch.maximum(m, b_lse)
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            fix, w = torch.exp(m - base), torch.exp(b_lse - base)
            l = l * fix + w
            acc = acc * fix[..., None] + o.float() * w[..., None]
            m = m_new
        if m is None:
            continue
        seen = ~torch.isinf(m)
        l_safe = torch.where(seen, l, torch.ones_like(l))
        out[:, :, i0:i1] = torch.where(seen[..., None], acc / l_safe[..., None], torch.zeros_like(acc)).to(q.dtype)
        lse[:, :, i0:i1] = torch.where(seen, m + torch.log(l_safe), m)
    return out, lse


def _cpu_backward(do, q, k, v, out, lse, scale, causal, window, keep, tile):
    B, H, T, D = q.shape
    S, past = k.shape[2], k.shape[2] - q.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # such rows get no gradient below
    for i0 in range(0, T, tile):
        i1 = min(i0 + tile, T)
        for j0, j1, kind in _key_blocks(i0, i1, S, past, causal, window):
            bias, diagonal, empty = _block_bias(i0, i1, j0, j1, past, causal, window, keep, kind, q.dtype, q.device)
            g = do[:, :, i0:i1]
            if empty is not None:  # rows that saw none of this block took nothing from it
                g = g.masked_fill(empty, 0.0)
            gq, gk, gv = _FLASH_CPU_BACKWARD(g, q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], out[:, :, i0:i1],
                                             safe[:, :, i0:i1], 0.0, diagonal, attn_mask=bias, scale=scale)
            dq[:, :, i0:i1] += gq
            dk[:, :, j0:j1] += gk
            dv[:, :, j0:j1] += gv
    return dq, dk, dv


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, keep, tile):
        fused = q.device.type == "cpu" and _FLASH_CPU is not None and not _PORTABLE
        k_heads = k.shape[1]
        if fused:  # the kernel wants as many key heads as query heads: O(T) copies
            rep = q.shape[1] // k.shape[1]
            k, v = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        tile = tile or (CPU_TILE if fused else TILE)
        out, lse = (_cpu_forward if fused else _forward)(q, k, v, scale, causal, window, keep, tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings, ctx.fused, ctx.kv_heads = (scale, causal, window, keep, tile), fused, k_heads
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        if not ctx.fused:
            return (*_backward(do.contiguous(), q, k, v, out, lse, *ctx.settings), None, None, None, None, None)
        dq, dk, dv = _cpu_backward(do.contiguous(), q, k, v, out, lse, *ctx.settings)
        rep = q.shape[1] // ctx.kv_heads
        if rep > 1:
            dk, dv = (t.view(t.shape[0], ctx.kv_heads, rep, *t.shape[2:]).sum(2) for t in (dk, dv))
        return dq, dk, dv, None, None, None, None, None


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    key_padding_mask: torch.Tensor | None = None, window: int | None = None,
                    scale: float | None = None, tile: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, H, T, D) and k, v (B, H_kv, S, D), S >= T (the queries are the
    last T positions), in O(T) memory; `key_padding_mask` (B, S): 1/True for keys that count. Where SDPA is the
    faster and stays linear or small (`_sdpa`) it runs instead; an explicit `tile` always tiles."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or k.shape[2] < q.shape[2]:
        raise ValueError(f"tiled attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "(B, H, T, D) / (B, H_kv, S, D) with H a multiple of H_kv and S >= T")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.bool)
    if tile is None:
        out = _sdpa(q, k, v, causal, keep, window, scale)
        if out is not None:
            return out
    return TiledAttention.apply(q, k, v, scale, causal, window, keep, tile)


def _sdpa(q, k, v, causal, keep, window, scale) -> torch.Tensor | None:
    """SDPA where it beats the tiles and its memory stays linear or small, else None (tile): a call with no mask
    to give (no padding, no window that hides a key, causal only with as many queries as keys), which SDPA's fused
    kernels serve in O(T) memory on CPU and CUDA; or any mask while B T S <= SDPA_LIMIT, spelled out densely."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    window = None if window is not None and window >= S else window  # past + i - j < S always
    plain = keep is None and window is None and (not causal or S == T)
    if not (B * T * S <= SDPA_LIMIT or (plain and q.device.type in FUSED_SDPA_DEVICES)):
        return None
    rep = H // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    allowed = StructuredMask(causal, window, keep).dense(B, T, S, q.device)
    empty = _blind_rows(T, S, causal, window, keep)
    if empty is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, scale=scale)  # they see all, then 0
    return out.masked_fill(empty, 0.0)


def _blind_rows(T: int, S: int, causal: bool, window: int | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, T, 1) True for the queries that see no key, or None when every query sees one; from the running
    count of kept keys (O(B S)), since query i sees the keys [i + past - window + 1, i + past] (causal) or from
    there on (not)."""
    if keep is None:  # a query sees its own position (causal), or the last key (not)
        return None
    seen = torch.nn.functional.pad(keep.to(torch.int32).cumsum(1), (1, 0))  # seen[:, j]: kept keys before j
    i = torch.arange(T, device=keep.device) + S - T
    hi = i + 1 if causal else torch.full_like(i, S)
    lo = (i - window + 1).clamp(min=0) if window is not None else torch.zeros_like(i)
    empty = (seen[:, hi] - seen[:, lo]) == 0
    return empty[:, None, :, None] if bool(empty.any()) else None


class StructuredMask(NamedTuple):
    """What the queries of a self-attention call may see, without the dense (B, 1, T, S) mask: causal or not,
    a sliding window, and the keys that count (B, S) or None. `Stack` passes it for long masked inputs
    (`DENSE_MASK_LIMIT`); `Attention` attends with `tiled_attention` on it, or spells it out where it must."""

    causal: bool
    window: int | None
    keep: torch.Tensor | None

    def dense(self, batch: int, q_len: int, k_len: int, device) -> torch.Tensor:
        """The boolean (B, 1, q_len, k_len) mask it stands for (True: may attend)."""
        allowed = _tile_mask(0, q_len, 0, k_len, k_len - q_len, self.causal, self.window, None, device)
        allowed = (torch.ones(q_len, k_len, dtype=torch.bool, device=device) if allowed is None else allowed)[None, None]
        if self.keep is not None:
            allowed = allowed & self.keep[:, None, None, :k_len].to(device=device, dtype=torch.bool)
        return allowed.expand(batch, 1, q_len, k_len)


# mask elements (B x T x S) past which a self-attention with padding or a window attends through the tiles
# instead of a dense mask: 64M, a 64 MB boolean mask that SDPA would also widen to the scores' dtype
DENSE_MASK_LIMIT = 1 << 26
