"""Longformer's self-attention: a sliding window per layer plus global tokens, in memory linear in the length.

A query i that is not global sees the keys j with |i - j| <= w (w = attention_window / 2) that are neither padding
nor global, plus every global token's key: softmax over those scores of q_i . k_j / sqrt(d). A global query sees
every unpadded key through its own projections: softmax(Q_g K_g^T / sqrt(d)) V_g with Q_g, K_g, V_g from
query_global, key_global and value_global (Beltagy et al. 2020, as transformers' LongformerSelfAttention computes
it). Padding queries output zeros.

The sequence is cut into blocks of w queries; block b reads the key blocks b - 1, b and b + 1 (3w keys), so the
scores take T * (3w + G) numbers for G global tokens, never T^2. The sequence is padded to a multiple of the
window inside (transformers pads the input ids to it; the padded keys are masked and their rows dropped, so both
give the same outputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn.attention import Attention
from lmkit.nn.kernels.block_tiles import KeyBlock, block_tiled_attention, key_chunks


@dataclass(frozen=True)
class TokenMask:
    """What a sparse attention layer needs of the mask, per token instead of an n x n bias: keep (B, T) bool, the
    unpadded tokens; glob (B, T) bool, the unpadded tokens with global attention."""

    keep: torch.Tensor
    glob: torch.Tensor


def token_mask(attention_mask: torch.Tensor | None, global_attention_mask: torch.Tensor | None, B: int, T: int,
               device: torch.device) -> TokenMask:
    """The per-token mask from the (B, T) attention and global attention masks (1 = keep / global), checked."""
    for name, m in (("attention_mask", attention_mask), ("global_attention_mask", global_attention_mask)):
        if m is not None and tuple(m.shape) != (B, T):
            raise ConfigError(f"{name} has shape {tuple(m.shape)} but the input ids have shape {(B, T)}; give one "
                              f"0/1 value per token, shaped like input_ids")
    keep = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.to(device) != 0
    glob = torch.zeros_like(keep) if global_attention_mask is None else (global_attention_mask.to(device) != 0) & keep
    return TokenMask(keep, glob)


def refuse_maps(attn: Attention) -> None:
    """Sparse attention never forms the T x T probabilities that attention maps (`lmkit.lens`) read."""
    if attn.keep_probabilities:
        raise ConfigError("attention maps are not kept by sparse attention (Longformer, BigBird): it never forms the "
                          "T x T probabilities; read maps from a dense model")


def global_slots(glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global positions of each row, in order, padded to the most any row has: index (B, G) and valid (B, G)."""
    count = glob.sum(1)
    G = int(count.max()) if glob.numel() else 0
    order = torch.sort((~glob).to(torch.int8), dim=1, stable=True).indices[:, :G]
    valid = torch.arange(G, device=glob.device)[None] < count[:, None]
    return order, valid


def softmax_at_least_fp32(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, in float32 for half-precision scores (as transformers does), back in their
    dtype."""
    wide = torch.float32 if scores.element_size() < 4 else scores.dtype
    return torch.softmax(scores, dim=-1, dtype=wide).to(scores.dtype)


def _gather_heads(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) at positions index (B, G) -> (B, H, G, D)."""
    B, H, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], D))


def _neighbours(x: torch.Tensor, w: int) -> torch.Tensor:
    """(B, H, nb * w, ...) cut into nb blocks of w; block b gets blocks b - 1, b, b + 1 side by side (zeros past the
    ends): (B, H, nb, 3w, ...)."""
    B, H, T = x.shape[:3]
    pad = [0, 0] * (x.dim() - 3) + [w, w]
    xb = F.pad(x, pad).view(B, H, T // w + 2, w, *x.shape[3:])
    return torch.cat([xb[:, :, :-2], xb[:, :, 1:-1], xb[:, :, 2:]], dim=3)


def sliding_global_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TokenMask, w: int,
                             dropout: float = 0.0) -> torch.Tensor:
    """Each query's softmax over the keys within w positions (neither padding nor global) and the global keys;
    q already scaled. q, k, v (B, H, T, D) -> (B, H, T, D), zeros at padding queries."""
    B, H, T, D = q.shape
    pad = -T % w
    keep, glob = mask.keep, mask.glob
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        keep, glob = F.pad(keep, (0, pad)), F.pad(glob, (0, pad))
    nb = q.shape[2] // w
    local = (keep & ~glob)[:, None, :]                                     # (B, 1, Tp)
    offsets = torch.arange(3 * w, device=q.device)[None] - w - torch.arange(w, device=q.device)[:, None]
    allowed = _neighbours(local, w)[:, :, :, None, :] & (offsets.abs() <= w)   # (B, 1, nb, w, 3w)
    qb = q.view(B, H, nb, w, D)
    scores = torch.matmul(qb, _neighbours(k, w).transpose(-1, -2))          # (B, H, nb, w, 3w)
    low = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~allowed, low)
    index, valid = global_slots(glob)
    G = index.shape[1]
    if G:
        kg, vg = _gather_heads(k, index)[:, :, None], _gather_heads(v, index)[:, :, None]   # (B, H, 1, G, D)
        to_global = torch.matmul(qb, kg.transpose(-1, -2)).masked_fill(~valid[:, None, None, None], low)
        scores = torch.cat([to_global, scores], dim=-1)
    probs = softmax_at_least_fp32(scores)
    probs = probs.masked_fill(~keep.view(B, 1, nb, w, 1), 0.0)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    out = torch.matmul(probs[..., G:], _neighbours(v, w))
    if G:
        out = out + torch.matmul(probs[..., :G], vg)
    return out.reshape(B, H, nb * w, D)[:, :, :T]


def use_tiles(dropout: float) -> bool:
    """Whether a sparse layer attends through block tiles: when autograd records (a training step, whose backward
    would otherwise keep the pattern's probabilities, T x (3w + G) numbers a head) and no dropout is asked (the
    tiles keep no probabilities to drop). Inference takes the batched blocks, the faster on CPU
    (docs/long_context.md); both give the same outputs."""
    return torch.is_grad_enabled() and not dropout


def sliding_global_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TokenMask, w: int) -> torch.Tensor:
    """`sliding_global_attention` without dropout through block tiles (`kernels/block_tiles.py`): each tile of
    queries reads the slice of keys within w of it and the global keys gathered, so no more than q, k, v, the output
    and its log-sum-exp are kept for backward. q already scaled; (B, H, T, D) -> (B, H, T, D)."""
    T = q.shape[2]
    local = (mask.keep & ~mask.glob)[:, None, None, :]                     # (B, 1, 1, T)
    index, valid = global_slots(mask.glob)
    extra = [KeyBlock(index[:, None, :], valid[:, None, None, :])] if index.shape[1] else []
    rows = max(w, 128 // w * w)  # whole windows per tile: fewer, larger calls

    def plan(i0: int, i1: int) -> list[KeyBlock]:
        j0, j1 = max(0, i0 - w), min(T, i1 + w)
        offset = torch.arange(i0, i1, device=q.device)[:, None] - torch.arange(j0, j1, device=q.device)[None]
        return [KeyBlock(slice(j0, j1), (offset.abs() <= w) & local[..., j0:j1]), *extra]

    out = block_tiled_attention(q, k, v, [(i0, min(i0 + rows, T)) for i0 in range(0, T, rows)], plan)
    return out.masked_fill(~mask.keep[:, None, :, None], 0.0)


class LongformerAttention(Attention):
    """Longformer's self-attention of one layer: q/k/v/o projections for the window, query_global, key_global and
    value_global for the global tokens' own rows; `window` is the layer's two-sided attention_window."""

    def __init__(self, config: ModelConfig, window: int):
        super().__init__(config, causal=False)
        d, inner = config.d_model, self.n_heads * self.head_dim
        bias = config.use_attention_bias
        self.q_global = nn.Linear(d, inner, bias=bias)
        self.k_global = nn.Linear(d, inner, bias=bias)
        self.v_global = nn.Linear(d, inner, bias=bias)
        self.window = window

    # projections with one output block per query head, which head pruning slices along with q_proj
    query_head_projections = ("q_global", "k_global", "v_global")

    def forward(self, x: torch.Tensor, bias: TokenMask | None = None, **kwargs) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); `bias` is the stack's `TokenMask` (none: every token kept, none global)."""
        B, T, _ = x.shape
        refuse_maps(self)
        mask = bias if bias is not None else token_mask(None, None, B, T, x.device)
        dropout = self.dropout if self.training else 0.0
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        q, k, v = self._project(x)
        q, k, v = self._heads(q, self.n_heads) * scale, self._heads(k, self.n_heads), self._heads(v, self.n_heads)
        tiles = use_tiles(dropout)
        if tiles:
            out = sliding_global_tiles(q, k, v, mask, self.window // 2)
        else:
            out = sliding_global_attention(q, k, v, mask, self.window // 2, dropout)
        index, valid = global_slots(mask.glob)
        if index.shape[1]:
            out = out.clone()
            out = self._global_rows(x, out, mask.keep, index, valid, scale, dropout, tiles)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _global_rows(self, x, out, keep, index, valid, scale, dropout, tiles):
        """out with each global token's row replaced by its attention over every kept key, through the global
        projections (in block tiles without dropout)."""
        B, H, T, D = out.shape
        xg = x.gather(1, index[:, :, None].expand(B, index.shape[1], x.shape[-1]))
        qg = self._heads(self.q_global(xg), H) * scale                          # (B, H, G, D)
        kg, vg = self._heads(self.k_global(x), H), self._heads(self.v_global(x), H)
        if tiles:
            rows = block_tiled_attention(qg, kg, vg, [(0, qg.shape[2])],
                                         lambda i0, i1: key_chunks(T, lambda j0, j1: keep[:, None, None, j0:j1]))
            return self._write_rows(out, rows, index, valid)
        scores = torch.matmul(qg, kg.transpose(-1, -2))                         # (B, H, G, T)
        scores = scores.masked_fill(~keep[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = F.dropout(softmax_at_least_fp32(scores), p=dropout)
        return self._write_rows(out, torch.matmul(probs, vg), index, valid)

    @staticmethod
    def _write_rows(out, rows, index, valid):
        """out with the global rows (B, H, G, D) written at their positions."""
        B, H, T, D = out.shape
        # slots past a row's own global count point at position 0 again: write only the valid ones
        target = torch.where(valid, index, T)                                   # invalid slots go to a spare row
        spare = torch.cat([out, out.new_zeros(B, H, 1, D)], dim=2)
        spare = spare.scatter(2, target[:, None, :, None].expand(B, H, target.shape[1], D), rows)
        return spare[:, :, :T]
