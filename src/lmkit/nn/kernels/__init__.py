"""The compiled CPU paths of lmkit's layers, behind one dispatch per operation chosen by device and dtype.

Operations (each a field of `Kernels`):
    attention(q, k, v, bias, is_causal, scale, dropout) = softmax(Q K^T * scale + mask) V (GQA when k has fewer heads)
    joined_attention(x, project, heads, kv_heads, scale): the same causal attention read from the joined
        projection project(x) = x [W_q; W_k; W_v]^T, or None where that fused path does not serve the call
    linear(x, W, b) = x W^T + b, gelu_tanh(x), gelu_tanh_linear(x, layer) = gelu_tanh(layer(x)),
    rms_norm(x, weight, eps) = weight * x / sqrt(mean(x^2) + eps)

`select(device, dtype)` answers once per (device type, parameter dtype); modules built on `UsesKernels` keep the
answer in `.kernels` and choose again whenever they move or change dtype (`.to`, `.cuda`, `.half` ... all go
through `_apply`). On a CPU with float32 parameters: the C++ causal attention kernel (`causal_attention`), the
wide linear layers' transposed weight gradient (`linear`), GELU with its bias in inductor's kernel (`gelu`),
attention in matrix products for bf16 autocast (`eager_attention`); with bf16/fp16 parameters the last; on any
CPU inductor's GELU and RMSNorm's closed-form backward (`rms_norm`). Anywhere else (CUDA, MPS): SDPA and
torch's own ops, and the CPU kernels never run. What a module's device and dtype cannot tell (gradients on,
autocast, tracing by torch.compile, a kernel that failed to build: LMKIT_COMPILE_KERNELS=0, LMKIT_CACHE) is
checked per call by the guards of `guards.py`, a few flag reads.

Training or inference mode is not part of the choice: gradients, not `module.training`, decide whether a
training kernel serves (a frozen model in eval mode still backpropagates into prompts and prefixes).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.nn.kernels import causal_attention, gelu
from lmkit.nn.kernels.eager_attention import LOW_PRECISION, eager_attention
from lmkit.nn.kernels.linear import linear as wide_linear
from lmkit.nn.kernels.rms_norm import rms_norm, rms_norm_trained

_EAGER_MAX_SCORES = 1 << 26  # score matrices above this many entries (128 MB in bf16) go to SDPA's flash kernel


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, is_causal: bool,
                   scale: float | None, dropout: float) -> torch.Tensor:
    """torch's scaled_dot_product_attention, key heads shared by groups of query heads."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _low_precision_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                                 is_causal: bool, scale: float | None, dropout: float) -> torch.Tensor:
    """bf16/fp16 training on CPU: matrix products (about twice SDPA's speed there) while the scores stay small."""
    B, H, T, _ = q.shape
    if q.dtype in LOW_PRECISION and torch.is_grad_enabled() and T > 1 and B * H * T * k.shape[2] <= _EAGER_MAX_SCORES:
        return eager_attention(q, k, v, bias, is_causal, scale, dropout)
    return sdpa_attention(q, k, v, bias, is_causal, scale, dropout)


def _float32_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                           is_causal: bool, scale: float | None, dropout: float) -> torch.Tensor:
    """float32 parameters on CPU: causal training in the compiled kernel; under bf16 autocast the
    low-precision path; otherwise SDPA."""
    T = q.shape[2]
    if (is_causal and bias is None and not dropout and T > 1 and T == k.shape[2] and k.shape[1] > 0
            and q.dtype == k.dtype == v.dtype and causal_attention.applies(q)):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return causal_attention.CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    return _low_precision_cpu_attention(q, k, v, bias, is_causal, scale, dropout)


def _joined_cpu_attention(x: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], heads: int,
                          kv_heads: int, scale: float) -> torch.Tensor | None:
    """The compiled kernel straight from the joined projection (no head split, no copies), when it serves x."""
    if not causal_attention.applies(x):
        return None
    return causal_attention.JoinedCausalAttention.apply(project(x), heads, kv_heads, scale)


def _torch_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _torch_gelu_tanh_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return F.gelu(layer(x), approximate="tanh")


def _cpu_gelu_tanh_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return gelu.gelu_tanh(layer(x))


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation of each operation for modules whose parameters are `dtype` on a `device_type` device."""

    device_type: str
    dtype: torch.dtype
    attention: Callable[..., torch.Tensor]
    joined_attention: Callable[..., torch.Tensor | None]
    linear: Callable[..., torch.Tensor]
    gelu_tanh: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_linear: Callable[[torch.Tensor, nn.Module], torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _no_joined_attention(*args) -> None:
    return None


@functools.cache
def select(device_type: str, dtype: torch.dtype) -> Kernels:
    """The kernels for parameters of `dtype` on a device of `device_type` ("cpu", "cuda", "mps" ...)."""
    if device_type != "cpu":
        return Kernels(device_type, dtype, attention=sdpa_attention, joined_attention=_no_joined_attention,
                       linear=F.linear, gelu_tanh=_torch_gelu_tanh, gelu_tanh_linear=_torch_gelu_tanh_linear,
                       rms_norm=rms_norm)
    float32 = dtype == torch.float32
    if float32:
        attention = _float32_cpu_attention
    elif dtype in LOW_PRECISION:
        attention = _low_precision_cpu_attention
    else:
        attention = sdpa_attention
    return Kernels(device_type, dtype, attention=attention,
                   joined_attention=_joined_cpu_attention if float32 else _no_joined_attention,
                   linear=wide_linear if float32 else F.linear, gelu_tanh=gelu.gelu_tanh,
                   gelu_tanh_linear=gelu.gelu_tanh_linear if float32 else _cpu_gelu_tanh_linear,
                   rms_norm=rms_norm_trained)


def for_module(module: nn.Module) -> Kernels:
    """select() for the device and dtype of the module's first floating-point parameter or buffer (CPU and the
    default dtype for a module that holds none)."""
    first = next((t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()), None)
    if first is None:
        return select("cpu", torch.get_default_dtype())
    return select(first.device.type, first.dtype)


class UsesKernels(nn.Module):
    """A module whose forward takes its operations from `self.kernels`: call `choose_kernels()` at the end of
    __init__; every later move or cast chooses again."""

    kernels: Kernels

    def choose_kernels(self) -> None:
        self.kernels = for_module(self)

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self.choose_kernels()
        return result


__all__ = ["Kernels", "UsesKernels", "for_module", "sdpa_attention", "select"]
