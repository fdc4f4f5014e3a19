"""Whether a tensor may go through lmkit's compiled CPU kernels and hand-written autograd Functions."""
from __future__ import annotations

import torch


def plain_eager(x: torch.Tensor) -> bool:
    """x is an ordinary tensor in eager mode: not traced by torch.compile or torch.jit, not wrapped by functorch
    (vmap, grad), where a kernel called through ctypes or a compiled function inside a Function cannot follow."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def float32_cpu_training(x: torch.Tensor) -> bool:
    """x is a float32 CPU tensor in plain eager mode with gradients enabled and autocast off: where lmkit's
    float32 training kernels (attention, the GELU with its bias, wide linear layers) take over from ATen's."""
    return (torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu") and plain_eager(x))
