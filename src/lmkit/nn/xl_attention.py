"""Transformer-XL relative attention (position kind "xl") with XLNet's two streams, and its layer.

Query i (absolute position m + i after m memory positions) scores key j of [memory; segment] as

    a_ij = ((q_i + u) . k_j  +  (q_i + v) . W_R R(c(m + i - j))  +  (q_i + s) . e[seg_i != seg_j]) / sqrt(d_head)

R(r) = [sin(r f), cos(r f)] with f_k = 10000^(-2k/d) (the sin half, then the cos half), c clamps the distance to
±clamp_len when clamp_len > 0, u, v, s are the per-head biases r_w_bias, r_r_bias, r_s_bias and e the two segment
encodings "same segment" / "other segment" (memory counts as segment 0).
Two streams share every weight: the content stream h attends to [memory; h] and sees itself; the query stream g
(started from mask_emb) asks at a target's position with the content of the others only, under a mask that also
hides the target itself. Each stream then goes through the post-norm residual and the same FFN.
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.attention import Attention
from lmkit.nn.blocks import Residual, build_ffn
from lmkit.nn.dropout import dropout


def relative_distances(q_len: int, k_len: int, clamp_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(distances (q_len + k_len - 1,) from k_len - 1 down to 1 - q_len, clamped; index (q_len, k_len) into them).

    Query i sits at k_len - q_len + i, so its distance to key j, k_len - q_len + i - j, is entry q_len - 1 - i + j."""
    distances = torch.arange(k_len - 1, -q_len, -1, device=device, dtype=torch.float32)
    if clamp_len > 0:
        distances = distances.clamp(-clamp_len, clamp_len)
    index = torch.arange(k_len, device=device)[None, :] + (q_len - 1 - torch.arange(q_len, device=device))[:, None]
    return distances, index


def relative_encoding(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """R(r) = [sin(r f), cos(r f)], f_k = 10000^(-2k/d): (len(distances), d_model) in float32."""
    inv_freq = 1 / torch.pow(10000, torch.arange(0, d_model, 2, device=distances.device).float() / d_model)
    angles = distances[:, None] * inv_freq
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class RelativeAttention(Attention):
    """q/k/v/o projections (no biases) of `Attention`, plus the position projection W_R (r_proj), the content,
    position and segment biases and the two segment encodings."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, causal=False)
        heads, dim = self.n_heads, self.head_dim
        self.r_proj = nn.Linear(config.d_model, heads * dim, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(heads, dim))
        self.r_r_bias = nn.Parameter(torch.zeros(heads, dim))
        self.r_s_bias = nn.Parameter(torch.zeros(heads, dim))
        self.seg_embed = nn.Parameter(torch.zeros(2, heads, dim))
        self.scale = config.resolved_head_dim ** -0.5

    def context(self, memory_and_h: torch.Tensor, encoding: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys, values (B, H, K, D) of [memory; h] and the projected encodings (H, R, D), shared by both streams."""
        k = self._heads(self.k_proj(memory_and_h), self.n_heads)
        v = self._heads(self.v_proj(memory_and_h), self.n_heads)
        r = self.r_proj(encoding.to(memory_and_h.dtype)).view(-1, self.n_heads, self.head_dim).transpose(0, 1)
        return k, v, r

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, ...], index: torch.Tensor,
                other_segment: torch.Tensor | None = None, blocked: torch.Tensor | None = None,
                target_mapping: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d) queries -> (B, T, d). index (T, K) picks each pair's distance; other_segment (B, T, K) bool;
        blocked (B, T, K) bool, True where query i may not see key j. With target_mapping (B, M, T), x holds M
        query-stream rows, each asking at the position(s) its mapping row names."""
        k, v, r = context
        q = self.q_proj(x).view(x.shape[0], x.shape[1], self.n_heads, self.head_dim)  # (B, T or M, H, D)
        if target_mapping is not None:
            q = torch.einsum("bmhd,bml->blhd", q, target_mapping.to(q.dtype))
        q = q.transpose(1, 2)  # (B, H, T, D)
        content = torch.matmul(q + self.r_w_bias[:, None], k.transpose(-1, -2))
        position = torch.matmul(q + self.r_r_bias[:, None], r.transpose(-1, -2))  # (B, H, T, R)
        scores = content + position.gather(-1, index.expand(*position.shape[:2], *index.shape))
        if other_segment is not None:
            seg = torch.einsum("bhtd,shd->bhts", q + self.r_s_bias[:, None], self.seg_embed)  # (B, H, T, 2)
            scores = scores + torch.where(other_segment[:, None], seg[..., 1:], seg[..., :1])
        scores = scores * self.scale
        if blocked is not None:  # a row that sees nothing comes out uniform, as transformers' - 1e30 makes it
            scores = scores.masked_fill(blocked[:, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        probs = dropout(probs, self.dropout, self.training)
        out = torch.matmul(probs, v).transpose(1, 2)  # (B, T, H, D)
        if target_mapping is not None:
            out = torch.einsum("blhd,bml->bmhd", out, target_mapping.to(out.dtype))
        return self.o_proj(out.reshape(out.shape[0], out.shape[1], -1))


class TwoStreamBlock(nn.Module):
    """One XLNet layer: x = LN(x + Attn(x)), x = LN(x + FFN(x)) for the content stream h and, when given, the query
    stream g, with the same weights; both attend to the content of [memory; h]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Residual(config, RelativeAttention(config))
        self.mlp = Residual(config, build_ffn(config))

    def forward(self, h: torch.Tensor, g: torch.Tensor | None, memory: torch.Tensor | None, encoding: torch.Tensor,
                index: torch.Tensor, other_segment: torch.Tensor | None, blocked_h: torch.Tensor | None,
                blocked_g: torch.Tensor | None, target_mapping: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = h if memory is None else torch.cat([memory.to(h.dtype), h], dim=1)
        context = self.self_attn.sublayer.context(keys, encoding)
        h_next = self.self_attn(h, context=context, index=index, other_segment=other_segment, blocked=blocked_h)
        if g is not None:
            g = self.mlp(self.self_attn(g, context=context, index=index, other_segment=other_segment,
                                        blocked=blocked_g, target_mapping=target_mapping))
        return self.mlp(h_next), g
