"""x W^T + b for float32 training on CPU, with the weight gradient formed in the faster orientation.

Backward: dX = dY W, db = sum of dY over rows, dW = dY^T X (out x in). sgemm computes that transposed-A
product faster when its result has more columns than rows (MKL, AVX2 and AVX-512 alike; docs/portability.md), so
for a layer wider out than in it forms dW^T = X^T dY and hands back its transpose; other layers keep dY^T X.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkit.nn.kernels.guards import float32_cpu_training


class _WideLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, weight.shape[0])
        dx = (dy @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = (x.reshape(-1, weight.shape[1]).t() @ dy).t() if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the same forward; for a layer wider out than in, in float32 CPU training, the weight
    gradient is the same product formed transposed (equal but for the order of float32 sums)."""
    if weight.shape[0] > weight.shape[1] and weight.requires_grad and weight.dtype == x.dtype and float32_cpu_training(x):
        return _WideLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
