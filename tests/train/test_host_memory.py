"""CPU training keeps freed activations in the heap: a re-allocated large tensor faults no fresh pages."""
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from lmkit.train.host_memory import keep_freed_memory
print(keep_freed_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(64 << 18).fill_(1.0)  # 64 MB, freed at once
before = faults()
for _ in range(10):
    torch.empty(64 << 18).fill_(2.0)
print(faults() - before)
"""


def _run(env_value: str) -> tuple[bool, int]:
    import os

    env = dict(os.environ, LMKIT_MALLOC_TUNING=env_value)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_are_reused_without_page_faults():
    tuned, tuned_faults = _run("1")
    if not tuned:
        pytest.skip("not glibc")
    untuned, untuned_faults = _run("0")
    assert not untuned
    pages = 10 * (64 << 20) // 4096
    assert untuned_faults > pages // 2  # each 64 MB tensor came from fresh, zeroed pages
    # the freed block is handed out again (the host may still reclaim idle pages now and then)
    assert tuned_faults < pages // 4

