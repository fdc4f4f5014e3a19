"""Prompt learning: prefix tuning (Li & Liang 2021) and prompt tuning (Lester et al. 2021).

Prefix tuning: every self-attention layer l gets P learned keys K_l and values V_l put in front of
its own, attention(Q, [K_l; K], [V_l; V]); every query may attend to the whole prefix.
Prompt tuning: P learned input embeddings E_p put in front of the token embeddings; the model sees
them as tokens with ids vocab_size .. vocab_size + P - 1 (so positions, scaling and norms apply as to words).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.nn.attention import Attention
from lmkit.nn.embeddings import Embeddings
from lmkit.peft.names import replace_module


class _PrefixCache:
    """What Attention sees as its cache: the real cache's keys (if any) with the prefix in front."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, real=None):
        self.prefix_k, self.prefix_v, self.real = keys, values, real
        self.cross: dict = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.real is not None:
            k, v = self.real.update(layer, k, v)
        B = k.shape[0]
        pk = self.prefix_k.to(k.dtype).expand(B, -1, -1, -1)
        pv = self.prefix_v.to(v.dtype).expand(B, -1, -1, -1)
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)

    def get_seq_length(self, layer: int = 0) -> int:
        return self.real.get_seq_length(layer) if self.real is not None else 0


class PrefixAttention(nn.Module):
    """Self-attention with P learned key/value positions (n_kv_heads, P, head_dim) before the sequence."""

    def __init__(self, attn: Attention, num_virtual_tokens: int, std: float = 0.02):
        super().__init__()
        self.attn = attn
        self.num_virtual_tokens = P = num_virtual_tokens
        w = attn.q_proj.weight
        shape = (1, attn.n_kv_heads, P, attn.head_dim)
        self.prefix_keys = nn.Parameter(torch.randn(shape, device=w.device, dtype=w.dtype) * std)
        self.prefix_values = nn.Parameter(torch.randn(shape, device=w.device, dtype=w.dtype) * std)

    def _extend(self, bias: torch.Tensor | None, is_causal: bool, B: int, T: int, device) -> torch.Tensor | None:
        P = self.num_virtual_tokens
        if bias is None and is_causal:
            q = torch.arange(T, device=device)[:, None]
            k = torch.arange(P + T, device=device)[None, :]
            return (k <= q + P)[None, None].expand(B, 1, T, P + T)
        if bias is None:
            return None
        pad = torch.ones if bias.dtype == torch.bool else torch.zeros
        return torch.cat([pad(*bias.shape[:-1], P, dtype=bias.dtype, device=bias.device), bias], dim=-1)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, is_causal: bool = False,
                rope=None, cache=None, layer: int = 0, memory=None) -> torch.Tensor:
        bias = self._extend(bias, is_causal, x.shape[0], x.shape[1], x.device)
        return self.attn(x, bias=bias, is_causal=False, rope=rope, cache=_PrefixCache(
            self.prefix_keys, self.prefix_values, cache), layer=layer)


def apply_prefix(model: nn.Module, num_virtual_tokens: int = 10) -> list[str]:
    """Wrap every self-attention module in a PrefixAttention; the names wrapped."""
    names = [n for n, m in model.named_modules() if isinstance(m, Attention) and not m.cross]
    for name in names:
        replace_module(model, name, PrefixAttention(model.get_submodule(name), num_virtual_tokens))
    return names


class PromptEmbedding(nn.Module):
    """Token lookup where ids >= vocab_size pick learned prompt vectors: E[x] or E_p[x - vocab_size]."""

    def __init__(self, tokens: nn.Embedding, num_virtual_tokens: int):
        super().__init__()
        self.tokens = tokens
        self.vocab_size = tokens.num_embeddings
        self.num_virtual_tokens = num_virtual_tokens
        # initialised from randomly chosen word embeddings, which trains better than random vectors (Lester et al.)
        pick = torch.randint(0, self.vocab_size, (num_virtual_tokens,))
        self.prompt_embeddings = nn.Parameter(tokens.weight.detach()[pick].clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.tokens.weight

    @property
    def num_embeddings(self) -> int:
        return self.vocab_size

    @property
    def embedding_dim(self) -> int:
        return self.tokens.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        virtual = ids >= self.vocab_size
        out = self.tokens(ids.masked_fill(virtual, 0))
        if bool(virtual.any()):
            prompt = self.prompt_embeddings[(ids - self.vocab_size).clamp(min=0)].to(out.dtype)
            out = torch.where(virtual[..., None], prompt, out)
        return out


def apply_prompt(model: nn.Module, num_virtual_tokens: int = 10) -> list[str]:
    """Replace the token-embedding modules by PromptEmbedding (one shared module if they are shared)."""
    done: dict[int, PromptEmbedding] = {}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Embeddings):
            tokens = module.tokens
            if id(tokens) not in done:
                done[id(tokens)] = PromptEmbedding(tokens, num_virtual_tokens)
            module.tokens = done[id(tokens)]
            names.append(f"{name}.tokens")
    return names
