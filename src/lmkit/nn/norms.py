"""Normalization layers.

LayerNorm(x) = (x - mean) / sqrt(var + eps) * gamma + beta over the feature axis only;
RMSNorm(x) = x / sqrt(mean(x^2) + eps) * gamma (no centring, no beta).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.kernels import UsesKernels


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last axis, with an optional bias (beta)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)


class RMSNorm(UsesKernels):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * gamma, computed in float32 as LLaMA and T5 do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.choose_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def build_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm the config asks for, over `dim` features (default d_model)."""
    dim = dim or config.d_model
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.norm_eps)
    return LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)
