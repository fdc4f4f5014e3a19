"""`lmkit rag index`'s progress (a bar over the documents chunked, then one over the chunks embedded, whose total is
the number of chunks) and --limit (the first N documents; a larger N later adds the rest)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from lmkit.cli import main
from lmkit.rag import RagIndex
from lmkit.rag.store import flat_vectors

pytest.importorskip("faiss")
from test_rag import DOCS, _tiny_encoder  # noqa: E402

TEXTS = [d for d in DOCS if d.text.strip()]  # a blank document is no document of a corpus file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_path):
    return _tiny_encoder(tmp_path_factory.mktemp("tiny"), minilm_path, 0)


@pytest.fixture
def bars(monkeypatch):
    """Every bar rag index opens, drawn (as on a terminal) into a buffer: [(settings, bar)]."""
    from tqdm import tqdm

    import lmkit.rag.store as store

    opened = []

    def forced(enabled: bool = True, **kwargs):
        bar = tqdm(file=io.StringIO(), disable=not enabled, **kwargs)
        opened.append((kwargs, bar))
        return bar

    monkeypatch.setattr(store, "progress_bar", forced)
    return opened


def test_bars_count_documents_then_every_chunk_embedded(tiny, tmp_path, capsys, bars):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in TEXTS))
    assert main(["rag", "index", "--encoder", str(tiny), "--corpus", str(corpus), "--out", str(tmp_path / "ix"),
                 "--precision", "fp32", "--chunk-tokens", "8", "--overlap", "2", "--batch-size", "2"]) == 0
    index = RagIndex.open(tmp_path / "ix")
    assert len(index) > 8  # more chunks than one slice of 4 batches of 2: the bar moves several times
    (chunk_settings, chunk_bar), (embed_settings, embed_bar) = bars
    assert chunk_settings["desc"] == "chunk" and chunk_bar.total == chunk_bar.n == len(TEXTS)
    assert embed_settings["desc"] == "embed" and embed_bar.total == embed_bar.n == len(index)
    assert f"{len(index)}/{len(index)}" in embed_bar.fp.getvalue()
    assert f"{len(index)} chunks embedded" in capsys.readouterr().err

    # embedding in slices for the bar gives the vectors of one call
    ids, stored = flat_vectors(index.index)
    np.testing.assert_allclose(stored, index.embed([index.chunks[int(i)].text for i in ids]), atol=1e-5)


def test_limit_indexes_the_first_documents_and_a_larger_one_adds_the_rest(tiny, tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    kept = TEXTS
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in kept))
    base = ["rag", "index", "--encoder", str(tiny), "--corpus", str(corpus), "--out", str(tmp_path / "ix"),
            "--precision", "fp32", "--chunk-tokens", "20", "--overlap", "4"]
    assert main(base + ["--limit", "2"]) == 0
    assert sorted(RagIndex.open(tmp_path / "ix").documents) == sorted(d.id for d in kept[:2])
    capsys.readouterr()
    assert main(base + ["--limit", "4"]) == 0
    assert "2 added, 0 replaced, 2 unchanged" in capsys.readouterr().err
    assert main(base + ["--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err
