"""Which floating-point format a run uses by default: bf16 only where this CPU multiplies it natively."""
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


def default_precision() -> str:
    return "bf16" if bf16_supported() else "fp32"
