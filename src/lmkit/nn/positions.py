"""Position information: sinusoidal table, rotary embeddings (RoPE) and T5 relative-position bias.

Sinusoidal: P[i, 2m] = sin(i / base^(2m/d)), P[i, 2m+1] = cos(i / base^(2m/d)).
RoPE rotates each pair of query/key features by the angle i * theta^(-2m/d), so that
q_i . k_j depends on the offset i - j only. T5 adds a learned bias b(bucket(j - i)) per head.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError


def sinusoidal_table(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The (n_positions, dim) table of Vaswani et al. with sin on even and cos on odd features."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table.float()


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, factor: float, scaling: dict) -> torch.Tensor:
    """YaRN: inv_freq / factor for the dimensions that turn fewer than beta_slow times over the original
    context, inv_freq as it is for those that turn more than beta_fast times, a linear ramp in between."""
    if scaling.get("original_max_position_embeddings") is None:
        raise ConfigError("YaRN RoPE scaling needs original_max_position_embeddings (the context it stretches)")
    old_len = float(scaling["original_max_position_embeddings"])

    def dim_of(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the original context
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor on cos and sin: YaRN's attention_factor (0.1 ln(factor) + 1 unless given); 1 otherwise."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor", 1.0))

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()


def rope_inverse_frequencies(dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """inv_freq[m] = theta^(-2m/dim), adjusted by linear, NTK-aware, llama3 or YaRN scaling."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind in ("ntk", "ntk-aware"):
        theta = theta * factor ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn(inv_freq, dim, theta, factor, scaling)
    elif kind not in ("default", "ntk", "ntk-aware", "dynamic"):
        raise ConfigError(f"RoPE scaling {kind!r} is not supported; use linear, ntk, dynamic, llama3 or yarn")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for given positions; `apply_rotary` rotates queries and keys."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dim = config.resolved_head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling or {}
        if self.scaling.get("rope_type", self.scaling.get("type")) == "yarn":  # by default YaRN stretches max_seq_len
            self.scaling = {"original_max_position_embeddings": config.max_seq_len, **self.scaling}
        self.max_seq_len = config.max_seq_len
        self.interleaved = config.rope_interleaved
        self.register_buffer("inv_freq", rope_inverse_frequencies(self.dim, self.theta, self.scaling), persistent=False)
        self.attention_factor = rope_attention_factor(self.scaling)

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic NTK: grow the base once the sequence outruns the trained context."""
        factor = float(self.scaling.get("factor", 1.0))
        if seq_len <= self.max_seq_len:
            return self.inv_freq
        base = self.theta * ((factor * seq_len / self.max_seq_len) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return rope_inverse_frequencies(self.dim, base).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (B, T, dim), for integer positions (B, T)."""
        inv_freq = self.inv_freq
        if self.scaling.get("rope_type", self.scaling.get("type")) == "dynamic":
            inv_freq = self._dynamic_inv_freq(int(position_ids.max()) + 1)
        angles = position_ids[..., None].float() * inv_freq.float()
        emb = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((angles, angles), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles behind cos/sin (B, T, D): x cos + rotate(x) sin."""
    return x * cos[:, None] + _rotate(x, interleaved) * sin[:, None]


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(cos, s, rolled) for `apply_rotary_factors` over x (B, H, T, D), from cos/sin (B, T, D), prepared once for
    every x rotated by the same angles. Without interleaving rotate(x) sin = roll(x, D/2) s, with s the sin whose
    first half is negated (the same products, in one roll instead of two slices, a negation and a join)."""
    cos, sin = cos[:, None], sin[:, None]
    if interleaved:
        return cos, sin, False
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), True


def apply_rotary_factors(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, bool]) -> torch.Tensor:
    """`apply_rotary` on factors from `rotary_factors`: x cos + rotate(x) sin."""
    cos, s, rolled = factors
    if rolled:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * s
    return x * cos + _rotate(x, True) * s


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of j - i: exact for small offsets, logarithmic up to max_distance, then clamped."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RelativePositionBias(nn.Module):
    """Learned per-head bias of T5, b[h, bucket(j - i)], added to the attention scores."""

    def __init__(self, config: ModelConfig, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_buckets
        self.max_distance = config.relative_max_distance
        self.bias = nn.Embedding(config.relative_buckets, config.n_heads)

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:
        """Bias (1, H, q_len, k_len) for queries at positions offset..offset+q_len-1."""
        device = self.bias.weight.device
        context = torch.arange(offset, offset + q_len, device=device)[:, None]
        memory = torch.arange(k_len, device=device)[None, :]
        buckets = relative_position_bucket(memory - context, self.bidirectional, self.num_buckets, self.max_distance)
        return self.bias(buckets).permute(2, 0, 1)[None]
