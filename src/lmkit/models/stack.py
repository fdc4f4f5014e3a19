"""A stack of transformer blocks over embeddings: the body every family shares.

Decoder stacks are causal; encoder stacks see every position; the decoder of an
encoder-decoder model also cross-attends to the encoder output (`memory`).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn import (Attention, Block, Embeddings, KVCache, RelativePositionBias, RotaryEmbedding,
                      build_attention_bias, build_norm)
from lmkit.nn.kernels.tiled_attention import DENSE_MASK_LIMIT, StructuredMask
from lmkit.nn.masks import additive_mask, allowed_positions
from lmkit.nn.moe import MoEFeedForward, load_balancing_loss
from lmkit.nn.plain import plain
from lmkit.nn.sparse_attention import token_mask


class Stack(nn.Module):
    """Embeddings, n blocks and an optional final norm; returns the last hidden states."""

    def __init__(self, config: ModelConfig, causal: bool, cross: bool = False, n_layers: int | None = None,
                 embeddings: Embeddings | None = None):
        super().__init__()
        self.config = config
        self.causal = causal
        self.embeddings = embeddings if embeddings is not None else Embeddings(config)
        self.rotary = RotaryEmbedding(config) if config.position == "rope" else None
        self.relative_bias = RelativePositionBias(config, bidirectional=not causal) if config.position == "relative" else None
        self.layers = nn.ModuleList(Block(config, causal=causal, cross=cross, layer=i)
                                    for i in range(n_layers or config.n_layers))
        if config.attention_scale_by_layer:  # as GPT-2's scale_attn_by_inverse_layer_idx: 1/sqrt(d_head) / (i + 1)
            base = config.attention_scale if config.attention_scale is not None else config.resolved_head_dim ** -0.5
            for i, block in enumerate(self.layers):
                block.self_attn.sublayer.scale = base / float(i + 1)
        self.norm = build_norm(config) if config.final_norm else None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, memory: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                keep: torch.Tensor | None = None, global_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states (B, T, d); with `keep` (positions 0..T-1) those at `keep` alone, (B, len(keep), d),
        the last block then attending and running its FFN at those positions only (`_prunes`). `attention_mask`
        may also be a dict {window (None: full attention): prepared (B, 1, T, past + T) mask} where the caller lays
        keys out itself (the serving engine's slots): each layer takes the entry of its `config.layer_window`.
        global_attention_mask (B, T): the tokens with global attention of a sparse (Longformer) stack."""
        if inputs_embeds is None:
            B, T = input_ids.shape
        else:
            B, T = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            device = (input_ids if input_ids is not None else inputs_embeds).device
            position_ids = torch.arange(past, past + T, device=device)[None].expand(B, T)
        h = self.embeddings(input_ids, position_ids=position_ids, token_type_ids=token_type_ids,
                            inputs_embeds=inputs_embeds)
        dtype, device = h.dtype, h.device
        windows = [self.config.layer_window(i) if self.causal else None for i in range(len(self.layers))]
        sparse = self.config.sparse.get("sparse_attention")
        if global_attention_mask is not None and sparse != "longformer":
            raise ConfigError("global_attention_mask is read by Longformer models only; leave it out for this model")
        if sparse is not None:  # a per-token mask; the layers never build T x T
            masks = {None: (token_mask(attention_mask, global_attention_mask, B, T, device), False)}
        elif isinstance(attention_mask, dict):  # prepared masks per window, as transformers 5's mask mapping
            masks = {w: build_attention_bias(attention_mask[w], B, T, past + T, self.causal, dtype, device, w)
                     for w in set(windows)}
        else:
            masks = {w: self._structured_mask(attention_mask, B, T, past, w)
                     or self._self_attention_bias(attention_mask, B, T, past, dtype, device, w) for w in set(windows)}
        rope = self.rotary(position_ids, dtype) if self.rotary is not None else None
        memory_bias = None
        if memory is not None and memory_mask is not None:
            memory_bias, _ = build_attention_bias(memory_mask, B, T, memory.shape[1], False, dtype, device)
        last = len(self.layers) - 1
        prune = keep is not None and self._prunes(keep)
        for i, layer in enumerate(self.layers):
            bias, is_causal = masks[windows[i]]
            extra = {"queries": keep} if prune and i == last else {}
            h = layer(h, bias=bias, is_causal=is_causal, rope=rope, cache=cache, layer=i, memory=memory,
                      memory_bias=memory_bias, **extra)
        if keep is not None and not prune:
            h = h[:, keep]
        if self.norm is not None:
            h = self.norm(h)
        return h

    def _prunes(self, keep: torch.Tensor) -> bool:
        """Whether the last block may compute its output at `keep` alone: a plain self-attention block
        (`lmkit.nn.plain`: no adapter or prefix wrapped around its attention, no hooks anywhere in it), no
        cross-attention or kept attention probabilities, a dense FFN (a mixture's load-balancing loss counts every
        position)."""
        if not self.layers or keep.dim() != 1 or self.config.n_experts:
            return False
        block = self.layers[-1]
        return plain(block, Block, deep=True) and block.cross_attn is None \
            and plain(block.self_attn.sublayer, Attention) and not block.self_attn.sublayer.keep_probabilities

    def _self_attention_bias(self, attention_mask: torch.Tensor | None, B: int, T: int, past: int, dtype: torch.dtype,
                             device: torch.device, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) of the T queries over past + T keys for layers that slide over `window` (None: all)."""
        if self.relative_bias is None:
            return build_attention_bias(attention_mask, B, T, past + T, self.causal, dtype, device, window)
        allowed = allowed_positions(attention_mask, B, T, past + T, self.causal, device, window)
        bias = self.relative_bias(T, past + T, offset=past).to(dtype)
        if allowed is not None:
            bias = bias + additive_mask(allowed, dtype)
        return bias, False

    def _structured_mask(self, attention_mask: torch.Tensor | None, B: int, T: int, past: int,
                         window: int | None) -> tuple[StructuredMask, bool] | None:
        """(StructuredMask, False) where a dense mask would pass DENSE_MASK_LIMIT elements for padding or a
        window, and every self-attention is plain (adapters and prefixes extend the dense mask); else None."""
        S = past + T
        keep = attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask[:, :S].all())
        windowed = self.causal and window is not None and S > window
        if (not keep and not windowed) or self.relative_bias is not None or B * T * S < DENSE_MASK_LIMIT \
                or not all(plain(layer.self_attn.sublayer, Attention) for layer in self.layers):
            return None
        return StructuredMask(self.causal, window if windowed else None,
                              attention_mask[:, :S].bool() if keep else None), False

    def moe_layers(self) -> list[nn.Module]:
        """The mixture-of-experts FFNs of the blocks, in layer order (found through any PEFT wrapper)."""
        return [m for layer in self.layers for m in layer.mlp.modules() if isinstance(m, MoEFeedForward)]

    def router_logits(self) -> tuple[torch.Tensor, ...] | None:
        """Each MoE layer's router logits (B*T, N) from the last forward; None for a dense stack."""
        moe = self.moe_layers()
        return tuple(m.router_logits for m in moe) if moe and moe[0].router_logits is not None else None

    def aux_loss(self, row_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Load-balancing loss of the last forward, all layers pooled, rows with row_mask == 0 left out
        (row_mask: (B, T) over the positions that forward ran on)."""
        logits = self.router_logits()
        if logits is None:
            return None
        moe = self.moe_layers()[0]
        return load_balancing_loss(logits, moe.n_experts, moe.top_k, row_mask)
