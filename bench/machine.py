"""What a benchmark ran on: the CPU, whether it has native bf16, the precisions run, and the bf16 rows left out.

Where bf16 is emulated (no AVX512-BF16 or AMX: lmkit's `bf16_supported()` is False, for example on AVX2-only
CPUs or under ONEDNN_MAX_CPU_ISA=AVX2) a bf16 matrix product is tens of times slower than fp32, so a bf16 row
would run for many minutes and measure the emulation: benchmarks skip it and say why (LMKIT_BENCH_BF16=1 runs
it anyway).
"""
from __future__ import annotations

import os
import platform

SKIP_REASON = ("bf16 is not native on this CPU (no AVX512-BF16 or AMX; emulated bf16 matrix products are tens of "
               "times slower than fp32); LMKIT_BENCH_BF16=1 runs them anyway")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform reports)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def bf16_native() -> bool:
    """lmkit's answer (imported here, so that tokenizer benchmarks that never need torch load it only to print)."""
    from lmkit.train.config import bf16_supported

    return bf16_supported()


def run_bf16() -> bool:
    """Whether the bf16 rows run: bf16 is native here, or LMKIT_BENCH_BF16=1 asks for them."""
    return bf16_native() or os.environ.get("LMKIT_BENCH_BF16") == "1"


def skipped_line(rows: str) -> str:
    """The line printed in place of bf16 rows left out."""
    return f"{rows}: skipped: {SKIP_REASON}"


def describe(ran: list[str] | tuple[str, ...]) -> str:
    """One line: CPU, cores, bf16 native or not (and any ISA cap in force), the precisions this run measured."""
    native = "native" if bf16_native() else "emulated"
    cap = ", ".join(f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                    if os.environ.get(k))
    return (f"CPU: {cpu_name()}, {os.cpu_count()} cores seen, bf16 {native}{f' ({cap})' if cap else ''}; "
            f"precisions run: {', '.join(ran) if ran else 'none (no floating-point model work)'}")
