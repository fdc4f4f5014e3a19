"""Keep the memory of freed tensors in the process during CPU training (glibc's malloc).

glibc serves allocations of 32 MB or more with mmap and returns them to the system when freed, and
gives back the top of its heap once 128 KB of it is free. A training step allocates and frees the
same large activations every time (the default run's float32 logits are 33 MB), so each step faults
tens of thousands of fresh, kernel-zeroed pages back in (docs/training.md measures the cost). With mmap off (M_MMAP_MAX = 0) and a 1 GiB trim threshold
(M_TRIM_THRESHOLD) freed blocks stay in the heap for the next step.
LMKIT_MALLOC_TUNING=0 leaves malloc as it is; other C libraries are left alone.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's M_MMAP_MAX to 0 and M_TRIM_THRESHOLD to 1 GiB for this process, once; True if set."""
    global _done
    if _done is None:
        _done = False
        if os.environ.get("LMKIT_MALLOC_TUNING", "1") != "0" and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                _done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            except (OSError, AttributeError):  # not glibc
                pass
    return _done
