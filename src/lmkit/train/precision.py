"""Which floating-point format a run uses by default: bf16 only where the device multiplies it natively (a CPU with
AVX512-BF16 or AMX, a CUDA GPU of compute capability 8.0 or more), else fp32. Fine-tuning (`fast_precision`)
asks more: that bf16 matrix products are also faster than fp32's there."""
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


def cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD" ...); "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def bf16_faster() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32, not only natively: with AMX, or on a CPU that is not
    Intel's (AMD's Zen 4 and later run AVX512-BF16's dot product at a higher rate than fp32's multiply-add). An
    Intel CPU with AVX512-BF16 but no AMX (for example a Sapphire or Emerald Rapids virtual machine that hides AMX:
    oneDNN then reports ISA avx512_core_bf16) runs that dot product no faster than fp32's multiply-add, so bf16
    autocast, which adds a cast of every weight and activation, makes a training step slower than fp32 there
    (docs/benchmarks.md, "Fine-tuning precision")."""
    if not bf16_supported():
        return False
    try:
        if torch.cpu._is_amx_tile_supported():
            return True
    except (AttributeError, RuntimeError):
        pass
    return cpu_vendor() != "GenuineIntel"


def fast_precision(device: torch.device | str | None = None) -> str:
    """default_precision(device), but fp32 on a CPU whose native bf16 is no faster than fp32 (`bf16_faster`): the
    default of the fine-tuning jobs (SFT, causal-LM and PEFT fine-tuning, classification, distillation)."""
    precision = default_precision(device)
    kind = torch.device(device).type if device is not None else "cpu"
    if precision == "bf16" and kind == "cpu" and not bf16_faster():
        return "fp32"
    return precision
