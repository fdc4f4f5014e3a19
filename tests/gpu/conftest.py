"""The GPU suite: the main paths on a CUDA device (docs/gpu.md says how to run it). Every test here is skipped
on a machine where torch sees no CUDA device, so `make test` on a CPU collects and skips it."""
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False); see docs/gpu.md")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(needs_cuda)


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 matmuls in full precision (no TF32), so GPU numbers compare with the CPU's."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
