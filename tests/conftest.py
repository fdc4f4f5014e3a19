"""Suite-wide settings: one intra-op thread per test process.

`make test` runs two pytest workers on a 2-core machine; letting each also spawn a thread per core
oversubscribes the CPU and makes small-model tests many times slower.
"""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
