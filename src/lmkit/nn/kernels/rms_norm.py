"""RMSNorm as a function: weight * x / sqrt(mean(x^2) + eps), the mean taken in float32.

`rms_norm` is the forward alone (torch's fused composite for float32); `RMSNormFunction` adds the backward in
closed form, one pass each way on CPU instead of autograd's chain of element-wise ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the mean taken in float32 and the result cast back first."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's own composite: the same products in the same order, in one call instead of seven
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = widen(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNormFunction(torch.autograd.Function):
    """rms_norm with its backward in closed form:
    x^ = x r, r = (mean(x^2) + eps)^(-1/2); dgamma = sum over rows of dy x^;
    dx = r (dx^ - x^ mean(dx^ x^)) with dx^ = dy gamma."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = widen(x)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (x32 * r).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        x_hat = widen(x) * r
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad * x_hat.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_hat = widen(grad * weight)
            d_x = ((d_hat - x_hat * (d_hat * x_hat).mean(-1, keepdim=True)) * r).to(x.dtype)
        return d_x, d_weight, None


def rms_norm_trained(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm, through RMSNormFunction's closed-form backward when a gradient is wanted."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm(x, weight, eps)
