"""Residual transformer blocks with pre-, post-, sandwich- or peri-norm placement.

pre:      x = x + F(LN(x))            (GPT-2, LLaMA)
post:     x = LN(x + F(x))            (Transformer 2017, BERT, BART)
sandwich: x = x + LN(F(x))            (the branch normalized before it joins the stream; OLMo-2's reordered
                                       norm)
peri:     x = x + LN'(F(LN(x)))       (norms on both sides of F: CogView's sandwich-LN, Gemma-2, Peri-LN)
Each block holds self-attention, optional cross-attention (decoders of encoder-decoder models)
and a feed-forward network (dense, or a mixture of experts when config.n_experts > 0).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.attention import Attention, KVCache
from lmkit.nn.dropout import Dropout
from lmkit.nn.ffn import FeedForward
from lmkit.nn.moe import MoEFeedForward
from lmkit.nn.norms import build_norm
from lmkit.errors import ConfigError
from lmkit.nn.bigbird_attention import BigBirdAttention
from lmkit.nn.sparse_attention import LongformerAttention


def build_ffn(config: ModelConfig) -> nn.Module:
    """A dense FFN, or a mixture of experts when the config has experts."""
    if config.n_experts:
        return MoEFeedForward(config)
    return FeedForward(config)


def build_self_attention(config: ModelConfig, causal: bool, layer: int) -> nn.Module:
    """The self-attention of layer `layer`: Longformer's or BigBird's where config.sparse says so, else `Attention`."""
    kind = config.sparse.get("sparse_attention")
    if kind == "longformer":
        window = config.sparse.get("attention_window")
        if window is None:
            raise ConfigError("a Longformer config needs attention_window (one even window per layer)")
        return LongformerAttention(config, window[layer])
    if kind == "bigbird":
        return BigBirdAttention(config, layer)
    return Attention(config, causal=causal)


class Residual(nn.Module):
    """One sub-layer F wrapped in its residual connection, norms and dropout."""

    def __init__(self, config: ModelConfig, sublayer: nn.Module):
        super().__init__()
        self.placement = config.norm_placement
        self.sublayer = sublayer
        self.norm = None if self.placement == "sandwich" else build_norm(config)  # before F, or after the sum (post)
        self.post_norm = build_norm(config) if self.placement in ("sandwich", "peri") else None  # on F's output
        self.dropout = Dropout(config.dropout)

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        return self.dropout(h) if self.training and self.dropout.p > 0 else h

    def forward(self, x: torch.Tensor, queries: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The residual's output; with `queries` (positions, for self-attention) at those positions alone, F
        reading every position of x."""
        stream = x
        if queries is not None:
            kwargs["queries"] = queries
            stream = x[:, queries]
        if self.placement == "post":
            return self.norm(stream + self._drop(self.sublayer(x, **kwargs)))
        h = self.sublayer(x if self.norm is None else self.norm(x), **kwargs)
        if self.post_norm is not None:
            h = self.post_norm(h)
        return stream + self._drop(h)


class Block(nn.Module):
    """Self-attention, optional cross-attention, then the feed-forward network."""

    def __init__(self, config: ModelConfig, causal: bool, cross: bool = False, layer: int = 0):
        super().__init__()
        self.self_attn = Residual(config, build_self_attention(config, causal, layer))
        self.cross_attn = Residual(config, Attention(config, causal=False, cross=True)) if cross else None
        self.mlp = Residual(config, build_ffn(config))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, is_causal: bool = False,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: KVCache | None = None,
                layer: int = 0, memory: torch.Tensor | None = None,
                memory_bias: torch.Tensor | None = None, queries: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output; with `queries` (positions) at those positions alone: every position's keys and
        values, then attention, cross-attention and the FFN at `queries` only (what a last block needs when
        only some positions' outputs are read)."""
        x = self.self_attn(x, bias=bias, is_causal=is_causal, rope=rope, cache=cache, layer=layer, queries=queries)
        if self.cross_attn is not None:
            x = self.cross_attn(x, bias=memory_bias, cache=cache, layer=layer, memory=memory)
        return self.mlp(x)
