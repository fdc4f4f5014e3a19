"""Multi-head, grouped-query and multi-query attention with a KV cache.

Attention(Q, K, V) = softmax(Q K^T * scale + bias) V per head, through the attention of the module's kernels
(`lmkit.nn.kernels`: SDPA, or on CPU the compiled causal kernel for float32 training and matrix products for
bf16). n_kv_heads < n_heads shares each key/value head among n_heads / n_kv_heads query heads (GQA; MQA when it
is 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn.kernels import UsesKernels
from lmkit.nn.kernels.eager_attention import attention_probabilities
from lmkit.nn.kernels.tiled_attention import StructuredMask, tiled_attention
from lmkit.nn.plain import plain
from lmkit.nn.positions import apply_rotary
from lmkit.nn.shifted_attention import shifted_sparse_attention


class KVCache:
    """Keys and values of past positions per layer, in buffers that grow by doubling.

    Self-attention entries grow with each step; cross-attention entries (keys and values of the
    encoder output) are computed once and kept as they are.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}
        self.cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get_seq_length(self, layer: int = 0) -> int:
        return self.lengths.get(layer, 0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, H, T, D) to the layer's entries and return all of them."""
        length = self.lengths.get(layer, 0)
        new = length + k.shape[2]
        buf_k = self.keys.get(layer)
        if buf_k is None or buf_k.shape[2] < new:
            capacity = max(new, 2 * (buf_k.shape[2] if buf_k is not None else 0), 64)
            grown_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            grown_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
            if length:
                grown_k[:, :, :length] = self.keys[layer][:, :, :length]
                grown_v[:, :, :length] = self.values[layer][:, :, :length]
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.keys[layer][:, :, length:new] = k
        self.values[layer][:, :, length:new] = v
        self.lengths[layer] = new
        return self.keys[layer][:, :, :new], self.values[layer][:, :, :new]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows in `index` (beam search), in that order."""
        for layer in list(self.keys):
            self.keys[layer] = self.keys[layer].index_select(0, index)
            self.values[layer] = self.values[layer].index_select(0, index)
        for layer, (k, v) in list(self.cross.items()):
            self.cross[layer] = (k.index_select(0, index), v.index_select(0, index))


def _query_rows(bias: torch.Tensor | None, is_causal: bool, queries: torch.Tensor, past: int,
                keys: int) -> tuple[torch.Tensor | None, bool]:
    """The mask of the query positions `queries` (after `past` cached ones) alone: the rows of `bias`, or for the
    causal mask SDPA would build (is_causal) key j <= past + i spelled out, None when each such query sees every
    key."""
    if bias is not None:
        return (bias if bias.shape[2] == 1 else bias[:, :, queries]), False
    if not is_causal:
        return None, False
    if bool((queries == keys - past - 1).all()):  # the last position sees every key
        return None, False
    allowed = torch.arange(keys, device=queries.device)[None] <= (past + queries)[:, None]
    return allowed[None, None], False


class Attention(UsesKernels):
    """Self- or cross-attention with q_proj, k_proj, v_proj and o_proj projections."""

    def __init__(self, config: ModelConfig, causal: bool, cross: bool = False):
        super().__init__()
        self.config = config
        self.causal = causal
        self.cross = cross
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.resolved_n_kv_heads, config.resolved_head_dim
        bias = config.use_attention_bias
        d = config.d_model
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.use_attention_out_bias)
        self.scale = config.attention_scale
        self.dropout = config.attention_dropout
        self._fused: tuple | None = None  # (key, weight, bias) of the fused q/k/v projection, for inference
        self.keep_probabilities = False  # opt-in: attend in matrix products and keep softmax(QK^T) in .probabilities
        self.probabilities: torch.Tensor | None = None
        self.s2_group: int | None = None  # LongLoRA's S2-Attn group while fine-tuning (`shifted_attention`); None: full
        self.choose_kernels()

    def plain_projections(self) -> bool:
        """q/k/v projections are plain nn.Linear layers (`lmkit.nn.plain`), so one joined product may replace them."""
        return plain(self.q_proj, nn.Linear) and plain(self.k_proj, nn.Linear) and plain(self.v_proj, nn.Linear)

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """[W_q; W_k; W_v]^T (d, q + 2 kv) and the joined biases, detached, rebuilt whenever a weight changes; None
        when the projections are not plain (LoRA, quantized layers and hooks keep their own forward).

        Stored transposed: x @ W^T with W^T contiguous is the faster matrix-vector product on CPU."""
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if not self.plain_projections():
            return None
        key = tuple((p.data_ptr(), 0 if p.is_inference() else p._version, p.dtype)
                    for m in mods for p in (m.weight, m.bias) if p is not None)
        if self._fused is None or self._fused[0] != key:
            weight = torch.cat([m.weight for m in mods]).detach().t().contiguous()
            bias = torch.cat([m.bias for m in mods]).detach() if self.q_proj.bias is not None else None
            self._fused = (key, weight, bias)
        return self._fused[1], self._fused[2]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, T, heads * head_dim) from one matrix product with [W_q; W_k; W_v] when the projections
        are plain: joined each step when gradients are needed, cached (transposed) at inference."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if torch.is_grad_enabled():
            if not self.plain_projections():
                return self.q_proj(x), self.k_proj(x), self.v_proj(x)
            return self._joined_projection(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        fused = self.fused_qkv()
        if fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weight_t, bias = fused
        flat = x.reshape(-1, x.shape[-1])
        qkv = flat @ weight_t if bias is None else torch.addmm(bias, flat, weight_t)
        return qkv.view(x.shape[0], x.shape[1], -1).split((q_dim, kv_dim, kv_dim), dim=-1)

    def _joined_projection(self, x: torch.Tensor) -> torch.Tensor:
        """x [W_q; W_k; W_v]^T + [b_q; b_k; b_v] (B, T, q + 2 kv), joined each call so gradients reach each weight."""
        mods = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([m.weight for m in mods])
        bias = torch.cat([m.bias for m in mods]) if self.q_proj.bias is not None else None
        return self.kernels.linear(x, weight, bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, is_causal: bool = False,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: KVCache | None = None,
                layer: int = 0, memory: torch.Tensor | None = None,
                queries: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). `memory` holds the encoder states for cross-attention. `queries` (positions
        among the T, for self-attention) gives the output (B, len(queries), d) at those alone: every position's
        keys and values are still computed (and cached), the rest of the queries are not attended with."""
        B, T, _ = x.shape
        dropout = self.dropout if self.training else 0.0
        s2 = self.s2_group if self.training and not self.cross and cache is None and queries is None else None
        tiles = isinstance(bias, StructuredMask)
        if tiles and (self.keep_probabilities or queries is not None or dropout or s2 is not None or self.cross):
            tiles, bias = False, bias.dense(B, T, T + (cache.get_seq_length(layer) if cache is not None else 0),
                                            x.device)
        if (s2 is None and not self.cross and rope is None and cache is None and queries is None and bias is None and is_causal
                and not dropout and not self.keep_probabilities and T > 1 and self.n_heads > 0 and self.head_dim > 0
                and self.plain_projections()):
            scale = self.head_dim ** -0.5 if self.scale is None else self.scale
            out = self.kernels.joined_attention(x, self._joined_projection, self.n_heads, self.n_kv_heads, scale)
            if out is not None:
                return self.o_proj(out)
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads)
            if cache is not None and layer in cache.cross:
                k, v = cache.cross[layer]
            else:
                k = self._heads(self.k_proj(memory), self.n_kv_heads)
                v = self._heads(self.v_proj(memory), self.n_kv_heads)
                if cache is not None:
                    cache.cross[layer] = (k, v)
        else:
            q, k, v = self._project(x)
            q, k, v = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
            if rope is not None:
                cos, sin = rope
                q = apply_rotary(q, cos, sin, self.config.rope_interleaved)
                k = apply_rotary(k, cos, sin, self.config.rope_interleaved)
                if q.dtype != v.dtype:  # under autocast the rotation ran in float32; attend in v's precision
                    q, k = q.to(v.dtype), k.to(v.dtype)
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if queries is not None:
                queries = queries.to(q.device)
                q = q[:, :, queries]
                bias, is_causal = _query_rows(bias, is_causal, queries, k.shape[2] - T, k.shape[2])
                T = q.shape[2]
        if tiles:  # FlashAttention's tiles on the mask's structure: O(T) memory
            out = tiled_attention(q, k, v, bias.causal, bias.keep, bias.window, self.scale)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if bias is not None and bias.dtype != torch.bool and bias.dtype != q.dtype:
            bias = bias.to(q.dtype)
        is_causal = is_causal and bias is None
        if s2 is not None:
            if not is_causal:
                raise ConfigError("S2-Attn (LongLoRA) trains on causal rows without padding or sliding windows; "
                                  "fine-tune this model without --longlora")
            out = shifted_sparse_attention(q, k, v, s2, self.scale, dropout)
        elif self.keep_probabilities:
            gqa = self.n_kv_heads != self.n_heads
            kq, vq = (k.repeat_interleave(self.n_heads // k.shape[1], 1),
                      v.repeat_interleave(self.n_heads // v.shape[1], 1)) if gqa else (k, v)
            scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
            self.probabilities = attention_probabilities(q, kq, bias, is_causal, scale)
            out = torch.matmul(F.dropout(self.probabilities, p=dropout) if dropout else self.probabilities, vq)
        else:
            out = self.kernels.attention(q, k, v, bias, is_causal, self.scale, dropout)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
