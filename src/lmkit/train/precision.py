"""Which floating-point format a run uses by default: bf16 only where the device multiplies it natively (a CPU with
AVX512-BF16 or AMX, a CUDA GPU of compute capability 8.0 or more), else fp32."""
from __future__ import annotations

import functools

import torch


@functools.cache
def bf16_supported() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); emulated bf16 is slower than fp32.
    oneDNN answers, so ONEDNN_MAX_CPU_ISA=AVX2 (set before Python starts) makes this False (docs/portability.md)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_precision(device: torch.device | str | None = None) -> str:
    """"bf16" or "fp32" for a run on `device` (None: the CPU). MPS stays fp32: its bf16 support depends on the
    macOS version and autocast there is partial."""
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if kind == "cpu":
        return "bf16" if bf16_supported() else "fp32"
    return "fp32"
