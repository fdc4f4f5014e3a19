"""Position-wise feed-forward networks.

Plain: down(act(up(x))) with ReLU, GELU (exact, tanh, or the sigmoid approximation x * sigmoid(1.702 x)). Gated (SwiGLU, GeGLU, ReGLU):
down(act(gate(x)) * up(x)). d_ff defaults to 4d, or 2/3 * 4d (rounded up to 8) for gated ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.dropout import Dropout
from lmkit.nn.kernels import UsesKernels
from lmkit.nn.kernels.gelu import gelu_tanh

def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's sigmoid approximation x * sigmoid(1.702 x) (Hendrycks and Gimpel 2016; CLIP's activation)."""
    return x * torch.sigmoid(1.702 * x)


_ACT = {
    "relu": F.relu, "reglu": F.relu,
    "gelu": F.gelu, "geglu": F.gelu,
    "gelu_tanh": gelu_tanh, "geglu_tanh": gelu_tanh,
    "silu": F.silu, "swiglu": F.silu,
    "quick_gelu": quick_gelu,
}
_TANH_GELU = ("gelu_tanh", "geglu_tanh")  # the activations the module's kernels compute


def activation(name: str):
    """The element-wise function behind an activation name (gated names give their gate's function)."""
    return _ACT[name]


class FeedForward(UsesKernels):
    """The FFN sub-layer: up_proj (and gate_proj when gated), activation, down_proj."""

    def __init__(self, config: ModelConfig, d_ff: int | None = None):
        super().__init__()
        d, hidden, bias = config.d_model, d_ff or config.resolved_d_ff, config.use_mlp_bias
        self.tanh_gelu = config.activation in _TANH_GELU
        self.gate_proj = nn.Linear(d, hidden, bias=bias) if config.gated else None
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.dropout = Dropout(config.activation_dropout)
        self.act = activation(config.activation)
        self.choose_kernels()

    def choose_kernels(self) -> None:
        super().choose_kernels()
        if self.tanh_gelu:
            self.act = self.kernels.gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        elif self.tanh_gelu:
            h = self.kernels.gelu_tanh_linear(x, self.up_proj)
        else:
            h = self.act(self.up_proj(x))
        if self.training and self.dropout.p > 0:
            h = self.dropout(h)
        return self.down_proj(h)
