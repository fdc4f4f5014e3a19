"""GELU (tanh form) as one compiled CPU kernel for float32, bf16 and fp16 activations.

gelu_tanh(x) = 0.5 x (1 + tanh(k (x + c x^3))) = x sigmoid(z),  z = 2k (x + c x^3),  k = sqrt(2/pi), c = 0.044715
d gelu_tanh / dx = s + x s (1 - s) 2k (1 + 3 c x^2),  s = sigmoid(z).

ATen evaluates tanh in bf16 at about a nanosecond per element on CPU, a third of a GPT-2 training
step's element-wise time. The sigmoid form, compiled by inductor into one pass (float32 inside,
one rounding to the input's dtype), is faster forward and backward (docs/benchmarks.md). For |x| < 2.5 it gives
ATen's bf16 numbers but for the last bit of fewer than 1 in 10,000 elements; further left, where ATen's
0.5 x (1 + tanh) cancels, it is the closer of the two to the exact value. In float32 (ATen's AVX2 GELU
backward takes about 3 ns per element) it is within a few float32 steps of the float64 value everywhere,
where ATen's form loses most digits in the negative tail. Each dtype's kernel is checked against the
float64 formula the first time it is used; without a working compiler, with a kernel that fails that
check, or with LMKIT_COMPILE_KERNELS=0, ATen's own GELU is used.
"""
from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F

from lmkit.nn.kernels.guards import float32_cpu_training, plain_eager
from lmkit.nn.kernels.linear import linear as training_linear
from lmkit.nn.kernels.rms_norm import widen
from lmkit.nn.plain import plain

_TWO_K = 2 * math.sqrt(2 / math.pi)
_TWO_KC = _TWO_K * 0.044715
_MIN_ELEMENTS = 1 << 14  # below this the compiled call's overhead outweighs the faster arithmetic
_log = logging.getLogger(__name__)


def _forward(x: torch.Tensor) -> torch.Tensor:
    f = widen(x)
    return (f * torch.sigmoid(f * (_TWO_K + _TWO_KC * f * f))).to(x.dtype)


def _backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    f = widen(x)
    f2 = f * f
    s = torch.sigmoid(f * (_TWO_K + _TWO_KC * f2))
    return (widen(grad) * (s + f * s * (1 - s) * (_TWO_K + 3 * _TWO_KC * f2))).to(grad.dtype)


def _forward_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _forward(x + b)


def _backward_bias(grad: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _backward(grad, x + b)


_compiled: tuple | None = None  # (forward, backward) once compiled, () when compiling is off or failed
_checked: dict = {}  # dtype -> whether the compiled kernels passed the check in that dtype
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# more than _MIN_ELEMENTS and not a multiple of the vector width: the vector loop and its tail both run
_PROBE_ELEMENTS = 4 * _MIN_ELEMENTS + 3


def _check(got: torch.Tensor, exact: torch.Tensor) -> None:
    """One rounding of a float32 result: within one step of the format (2**-7 relative for bf16) of the float64
    value. A compiler whose vector code is wrong here (inductor's AVX2 code under ATEN_CPU_CAPABILITY=avx2 on an
    AVX-512 CPU returns NaN for some inputs) fails this, and ATen's GELU is used instead."""
    bound = torch.finfo(got.dtype).eps * exact.abs() + 1e-5
    if not torch.isfinite(got).all() or ((got.double() - exact).abs() > bound).any():
        raise RuntimeError("the compiled kernel's numbers differ from the formula's")


def _probe(fwd, bwd, dtype: torch.dtype) -> None:
    """Compile (in no-grad mode, that of every later call) and check both kernels in `dtype`."""
    probe = torch.linspace(-6, 6, _PROBE_ELEMENTS, dtype=dtype)
    ones = torch.ones_like(probe)
    with torch.no_grad():
        _check(fwd(probe), _forward(probe.double()))
        _check(bwd(ones, probe), _backward(ones.double(), probe.double()))


def compiled_kernels() -> tuple:
    """(forward, backward) compiled by inductor on first use; () when that is not possible here."""
    global _compiled
    if _compiled is None:
        _compiled = ()
        if os.environ.get("LMKIT_COMPILE_KERNELS", "1") != "0":
            try:
                fwd = torch.compile(_forward, dynamic=True, fullgraph=True)
                bwd = torch.compile(_backward, dynamic=True, fullgraph=True)
                _probe(fwd, bwd, torch.bfloat16)
                _compiled = (fwd, bwd)
                _checked.clear()
                _checked[torch.bfloat16] = True
            except Exception as err:  # no C++ compiler, or inductor unavailable: ATen's GELU it is
                _log.info("compiled GELU unavailable (%s); using ATen's", err)
    return _compiled


def kernels_for(dtype: torch.dtype) -> tuple:
    """compiled_kernels() once they passed the check in `dtype` (each dtype compiles its own code); else ()."""
    kernels = compiled_kernels()
    if not kernels or dtype not in _DTYPES:
        return ()
    if dtype not in _checked:
        try:
            _probe(*kernels, dtype)
            _checked[dtype] = True
        except Exception as err:
            _log.info("compiled GELU unavailable in %s (%s); using ATen's", dtype, err)
            _checked[dtype] = False
    return kernels if _checked[dtype] else ()


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        # always the same guards (no grad, an input that needs none): one compiled variant per dtype, so the three
        # dtypes stay within dynamo's recompile limit
        with torch.no_grad():
            return compiled_kernels()[0](x.detach().view(-1)).view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return compiled_kernels()[1](grad.detach().contiguous().view(-1), x.detach().view(-1)).view(x.shape)


_bias_compiled: tuple | None = None  # (forward, backward) of gelu_tanh(x + b) in float32, () when unavailable


def bias_kernels() -> tuple:
    """gelu_tanh(x + b) and its x-gradient for float32 (x (N, F), b (F,)), compiled and checked on first use."""
    global _bias_compiled
    if _bias_compiled is None:
        _bias_compiled = ()
        if kernels_for(torch.float32):
            try:
                fwd = torch.compile(_forward_bias, dynamic=True, fullgraph=True)
                bwd = torch.compile(_backward_bias, dynamic=True, fullgraph=True)
                x = torch.linspace(-6, 6, 35 * 1871).view(-1, 35)[:, :-1].contiguous()  # rows of 34: no vector multiple
                b = torch.linspace(-1, 1, x.shape[1])
                ones = torch.ones_like(x)
                with torch.no_grad():
                    _check(fwd(x, b), _forward(x.double() + b.double()))
                    _check(bwd(ones, x, b), _backward(ones.double(), x.double() + b.double()))
                _bias_compiled = (fwd, bwd)
            except Exception as err:
                _log.info("compiled GELU with bias unavailable (%s); using ATen's", err)
    return _bias_compiled


class _GeluTanhBias(torch.autograd.Function):
    """gelu_tanh(x + b) for x (N, F): the bias of the preceding linear layer added inside the compiled kernel,
    so the layer's product need not first copy the broadcast bias into its output (addmm does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, b)
        with torch.no_grad():
            return bias_kernels()[0](x.detach(), b.detach())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, b = ctx.saved_tensors
        with torch.no_grad():
            dx = bias_kernels()[1](grad.detach().contiguous(), x.detach(), b.detach())
        return dx, dx.sum(0)


def gelu_tanh_linear(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """gelu_tanh(linear(x)); in float32 training on CPU the bias goes into the compiled GELU (one pass less)."""
    if not plain(linear, torch.nn.Linear):
        return gelu_tanh(linear(x))  # adapters, quantized layers and hooks keep their own forward
    weight, bias = linear.weight, linear.bias
    if (bias is not None and x.dtype == weight.dtype == bias.dtype and float32_cpu_training(x)
            and x.numel() // max(x.shape[-1], 1) * weight.shape[0] >= _MIN_ELEMENTS and bias_kernels()):
        h = training_linear(x, weight)
        return _GeluTanhBias.apply(h.view(-1, h.shape[-1]), bias).view(h.shape)
    return gelu_tanh(linear(x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"), through the compiled kernel for large contiguous float32/bf16/fp16 CPU tensors."""
    if (x.dtype in _DTYPES and x.device.type == "cpu" and x.is_contiguous()
            and x.numel() >= _MIN_ELEMENTS and plain_eager(x) and kernels_for(x.dtype)):
        if torch.is_grad_enabled() and x.requires_grad:
            return _GeluTanh.apply(x)
        with torch.no_grad():
            return compiled_kernels()[0](x.detach().view(-1)).view(x.shape)
    return F.gelu(x, approximate="tanh")
