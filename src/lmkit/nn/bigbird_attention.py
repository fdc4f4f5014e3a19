"""BigBird's block-sparse self-attention (Zaheer et al. 2020, the ITC pattern transformers' BigBird computes).

The sequence is cut into blocks of b tokens (padded inside to a multiple of b; the padded keys are masked and their
rows dropped). The first and last query blocks are global: they attend to every key. Every other query block i
attends to the key blocks {0, i - 1, i, i + 1, n - 1} (window and global blocks, each once) and to r random blocks
R_h(i) per head: softmax(q k^T / sqrt(d)) over those (5 + r) b keys, so the scores take T (5 + r) b numbers, never
T^2. Padding queries output zeros.

Random blocks: in training, R_h(i) holds r distinct blocks outside {0, i - 1, i, i + 1, n - 1}, drawn from the seed
random_seed + layer on every call (transformers reseeds each layer with its index on every call too). In eval
mode transformers 5 uses block 0 for every random block ("During inference (eval) no randomness"), and so does
lmkit, so a loaded model gives transformers' outputs.

Inputs of (5 + 2r) b tokens or fewer fall back to full attention (`attention_type` "original_full"), as
transformers' BigBirdModel does: the pattern needs that many to draw its random blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkit.config import ModelConfig
from lmkit.nn.attention import Attention
from lmkit.nn.kernels.block_tiles import KeyBlock, block_tiled_attention, key_chunks
from lmkit.nn.masks import build_attention_bias
from lmkit.nn.sparse_attention import TokenMask, refuse_maps, softmax_at_least_fp32, token_mask, use_tiles


def full_attention_needed(T: int, block: int, r: int) -> bool:
    """Whether T tokens are too few for the block-sparse pattern (transformers' fallback rule)."""
    return T <= (5 + 2 * r) * block


def random_blocks(n_blocks: int, r: int, heads: int, seed: int) -> torch.Tensor:
    """(heads, n_blocks - 2, r): for query block i = 1..n-2, r distinct key blocks outside {0, i - 1, i, i + 1,
    n - 1}, uniformly, from torch's CPU generator seeded with `seed` (the same blocks on any device)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(heads, n_blocks - 2, n_blocks, generator=g)
    i = torch.arange(1, n_blocks - 1)[:, None]
    j = torch.arange(n_blocks)[None]
    taken = ((j - i).abs() <= 1) | (j == 0) | (j == n_blocks - 1)
    return keys.masked_fill(taken, 2.0).topk(r, dim=-1, largest=False).indices


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, block: int,
                           rand: torch.Tensor) -> torch.Tensor:
    """BigBird's block-sparse attention, q already scaled. q, k, v (B, H, T, D) with T a multiple of `block`; keep
    (B, T) the unpadded keys; rand (H, n - 2, r) the random key blocks of query blocks 1..n-2. -> (B, H, T, D),
    zeros at padding queries."""
    B, H, T, D = q.shape
    n = T // block
    low = torch.finfo(q.dtype).min
    kb, vb = k.view(B, H, n, block, D), v.view(B, H, n, block, D)
    keep_b = keep.view(B, n, block)
    # the global query blocks 0 and n - 1 see every key
    q_glob = torch.cat([q[:, :, :block], q[:, :, -block:]], dim=2)
    scores = torch.matmul(q_glob, k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], low)
    glob_out = torch.matmul(softmax_at_least_fp32(scores), v)                      # (B, H, 2b, D)
    # query blocks 1..n-2: window and global key blocks (a slot that repeats another is switched off), then random
    i = torch.arange(1, n - 1, device=q.device)
    fixed = torch.stack([torch.zeros_like(i), i - 1, i, i + 1, torch.full_like(i, n - 1)], dim=1)   # (n - 2, 5)
    fixed_on = torch.ones_like(fixed, dtype=torch.bool)
    fixed_on[0, 1] = False                    # block 1: its window's first block is the global block 0
    fixed_on[-1, 3] = False                   # block n - 2: its window's last block is the global block n - 1
    index = torch.cat([fixed.expand(H, -1, -1), rand.to(q.device)], dim=2)         # (H, n - 2, 5 + r)
    slot_on = torch.cat([fixed_on, fixed_on.new_ones(n - 2, rand.shape[-1])], dim=1)
    flat = index.reshape(H, -1)                                                    # (H, (n - 2)(5 + r))
    gather = flat[None, :, :, None, None].expand(B, H, flat.shape[1], block, D)
    keys = kb.gather(2, gather).view(B, H, n - 2, -1, D)                           # (B, H, n - 2, (5 + r) b, D)
    values = vb.gather(2, gather).view(B, H, n - 2, -1, D)
    key_ok = keep_b[:, None].expand(B, H, n, block).gather(2, flat[None, :, :, None].expand(B, H, flat.shape[1], block))
    key_ok = (key_ok.view(B, H, n - 2, -1, block) & slot_on[None, None, :, :, None]).flatten(3)
    qb = q.view(B, H, n, block, D)[:, :, 1:-1]
    scores = torch.matmul(qb, keys.transpose(-1, -2)).masked_fill(~key_ok[:, :, :, None, :], low)
    mid_out = torch.matmul(softmax_at_least_fp32(scores), values).flatten(2, 3)    # (B, H, (n - 2) b, D)
    out = torch.cat([glob_out[:, :, :block], mid_out, glob_out[:, :, block:]], dim=2)
    return out.masked_fill(~keep[:, None, :, None], 0.0)


def block_sparse_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, block: int,
                       rand: torch.Tensor) -> torch.Tensor:
    """`block_sparse_attention` through block tiles (`kernels/block_tiles.py`), one query block a tile: the global
    blocks over every key in slices, a middle block i over the slice of blocks i - 1..i + 1, the global blocks 0 and
    n - 1 where that slice misses them, and its random blocks gathered per head (with their multiplicity). Only q, k,
    v, the output and its log-sum-exp are kept for backward. Same arguments and result."""
    B, H, T, _ = q.shape
    n = T // block
    kept = keep[:, None, None, :]                                              # (B, 1, 1, T)
    span = torch.arange(block, device=q.device)
    picks = (rand.to(q.device)[..., None] * block + span).flatten(2)           # (H, n - 2, r b)

    def plan(i0: int, i1: int) -> list[KeyBlock]:
        i = i0 // block
        if i in (0, n - 1):
            return key_chunks(T, lambda j0, j1: kept[..., j0:j1])
        j0, j1 = (i - 1) * block, (i + 2) * block
        blocks = [KeyBlock(slice(j0, j1), kept[..., j0:j1])]
        if i > 1:
            blocks.append(KeyBlock(slice(0, block), kept[..., :block]))
        if i < n - 2:
            blocks.append(KeyBlock(slice(T - block, T), kept[..., T - block:]))
        if picks.shape[-1]:
            at = picks[None, :, i - 1]                                         # (1, H, r b)
            blocks.append(KeyBlock(at, keep[:, None, :].expand(B, H, T).gather(2, at.expand(B, H, -1))[:, :, None]))
        return blocks

    out = block_tiled_attention(q, k, v, [(i * block, (i + 1) * block) for i in range(n)], plan)
    return out.masked_fill(~keep[:, None, :, None], 0.0)


class BigBirdAttention(Attention):
    """BigBird's self-attention of layer `layer`: block-sparse (config.sparse.attention_type "block_sparse", the
    default) with full attention for short inputs, or full ("original_full"); the projections are BERT's."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, causal=False)
        sparse = config.sparse
        self.block = sparse.get("block_size", 64)
        self.n_random = sparse.get("num_random_blocks", 3)
        self.sparse = sparse.get("attention_type", "block_sparse") == "block_sparse"
        self.seed = sparse.get("random_seed", 0) + layer

    def forward(self, x: torch.Tensor, bias: TokenMask | None = None, **kwargs) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); `bias` is the stack's `TokenMask` (its global tokens are not read: BigBird's
        global tokens are the first and last blocks)."""
        B, T, _ = x.shape
        mask = bias if bias is not None else token_mask(None, None, B, T, x.device)
        if not self.sparse or full_attention_needed(T, self.block, self.n_random):
            dense, _ = build_attention_bias(mask.keep.long(), B, T, T, False, x.dtype, x.device)
            return super().forward(x, bias=dense)
        refuse_maps(self)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        q, k, v = self._project(x)
        q, k, v = self._heads(q, self.n_heads) * scale, self._heads(k, self.n_heads), self._heads(v, self.n_heads)
        pad = -T % self.block
        keep = mask.keep
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            keep = F.pad(keep, (0, pad))
        n = keep.shape[1] // self.block
        if self.training:
            rand = random_blocks(n, self.n_random, self.n_heads, self.seed)
        else:  # transformers' eval mode: every random block is block 0
            rand = torch.zeros(self.n_heads, n - 2, self.n_random, dtype=torch.long)
        attend = block_sparse_tiles if use_tiles(0.0) else block_sparse_attention  # no dropout here, as transformers
        out = attend(q, k, v, keep, self.block, rand)[:, :, :T]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
