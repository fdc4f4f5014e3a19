"""RAG index and retrieval: token chunking, faiss index folders (update in place, fingerprints, damage,
atomic saves, IVF), BM25 and fusion, and parity with sentence-transformers + faiss and with bm25s used directly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmkit.data.corpus import Document
from lmkit.errors import CheckpointError, ConfigError, LmkitError
from lmkit.rag import RagIndex, chunk_document, retrieve, rrf
from lmkit.rag.chunks import TokenCounter

faiss = pytest.importorskip("faiss")
bm25s = pytest.importorskip("bm25s")

DOCS = [
    Document("cats", "Cats are small carnivorous mammals. They sleep for most of the day and hunt at night.\n\n"
                     "A group of cats is called a clowder; kittens are born blind."),
    Document("json", "The json module encodes Python objects as JSON text and decodes JSON documents back.\n"
                     "    dumps(obj) returns a string; loads(s) parses one."),
    Document("unicode", "Ünïcödé café naïve — déjà vu. 北京欢迎你，日本語のテキストも。 Привет, мир! emoji 🤗 ∑∫√"),
    Document("sqlite", "sqlite3 is a DB-API 2.0 interface for SQLite databases. Connections execute SQL statements "
                       "and cursors iterate over the rows a query returns. " * 6),
    Document("blank", "   \n\n  "),
    Document("pathlib", "Object-oriented filesystem paths: PurePath computes paths without touching the disk, "
                        "Path adds the methods that do I/O such as reading files and listing folders."),
]


def _tiny_encoder(folder: Path, minilm_path: Path, seed: int) -> Path:
    """A random 2-layer BERT of width 32 with MiniLM's tokenizer: a plain folder (mean pooling)."""
    import torch
    import transformers

    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=128)
    torch.manual_seed(seed)
    transformers.BertModel(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((minilm_path / name).read_bytes())
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_path) -> Path:
    return _tiny_encoder(tmp_path_factory.mktemp("tiny"), minilm_path, 0)


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory) -> Path:
    index = RagIndex.create(tiny, chunk_tokens=12, overlap=4)
    index.add(DOCS)
    out = tmp_path_factory.mktemp("ix") / "index"
    index.save(out)
    return out


def test_chunks_fit_overlap_and_cover(tiny):
    from lmkit.tokenizers import load_tokenizer

    tok = load_tokenizer(tiny)
    count = TokenCounter(tok)
    for doc in DOCS:
        for size, overlap in ((12, 4), (7, 0), (30, 29), (1, 0)):
            chunks = chunk_document(doc.id, doc.text, count, size, overlap)
            if not doc.text.strip():
                assert chunks == []
                continue
            for c in chunks:
                assert c.text == doc.text[c.start:c.end] and c.text == c.text.strip()
                # a single word longer than the budget is its own chunk; otherwise the budget holds
                if len(c.text.split()) > 1:
                    assert len(tok.encode(c.text, add_special_tokens=False)) <= size
            assert [c.n for c in chunks] == list(range(len(chunks)))
            assert chunks[0].start == len(doc.text) - len(doc.text.lstrip()) and chunks[-1].end == len(doc.text.rstrip())
            for a, b in zip(chunks, chunks[1:]):
                assert a.start < b.start
                assert doc.text[a.end:b.start].strip() == ""  # no word falls between two chunks
                if overlap == 0:
                    assert b.start >= a.end
                shared = doc.text[b.start:a.end]
                assert len(tok.encode(shared, add_special_tokens=False)) <= overlap


def test_sizes_checked(tiny):
    with pytest.raises(ConfigError, match="--chunk-tokens"):
        RagIndex.create(tiny, chunk_tokens=127)  # 128 positions less [CLS] and [SEP]
    with pytest.raises(ConfigError, match="--overlap"):
        RagIndex.create(tiny, chunk_tokens=10, overlap=10)


def _brute_force(index: RagIndex, query: str, k: int) -> list[tuple[str, str]]:
    ids = sorted(index.chunks)
    emb = index.embed([index.chunks[i].text for i in ids])
    scores = emb @ index.embed([query])[0]
    best = np.argsort(-scores, kind="stable")[:k]
    return [(index.chunks[ids[b]].source, index.chunks[ids[b]].text) for b in best]


def test_index_reopens_and_updates_in_place(built, tiny, tmp_path):
    index = RagIndex.open(built)
    assert set(index.documents) == {d.id for d in DOCS} and index.documents["blank"]["chunks"] == []
    for query in ("where do cats sleep", "parse JSON text", "北京", "SQL rows"):
        got = [(h.source, h.text) for h in retrieve(index, query, 4, "dense")]
        assert got == _brute_force(index, query, 4)
    # replacing one document, removing another, adding a third: equal to an index built from scratch
    changed = [Document("json", "The json module was rewritten: it now speaks YAML."), Document("new", "Zebras graze.")]
    counts = index.add(DOCS + changed[1:])
    assert counts == {"added": 1, "replaced": 0, "unchanged": len(DOCS), "chunks": 1}
    counts = index.add(changed[:1])
    assert counts["replaced"] == 1
    assert index.remove(["cats"]) > 0
    with pytest.raises(ConfigError, match="not in the index"):
        index.remove(["cats"])
    index.save(built.parent / "updated")
    fresh = RagIndex.create(tiny, chunk_tokens=12, overlap=4)
    fresh.add([d for d in DOCS if d.id not in ("cats", "json")] + changed[::-1])
    reopened = RagIndex.open(built.parent / "updated")
    for query in ("YAML", "cats sleep", "zebra", "filesystem paths"):
        for mode in ("dense", "bm25", "hybrid"):
            a = [(h.source, h.text, round(h.score, 5)) for h in retrieve(reopened, query, 5, mode)]
            b = [(h.source, h.text, round(h.score, 5)) for h in retrieve(fresh, query, 5, mode)]
            assert a == b, (query, mode)
            assert "cats" not in {s for s, _, _ in a}


def test_refused_by_fingerprint(built, tiny, tmp_path, minilm_path):
    other = _tiny_encoder(tmp_path / "other", minilm_path, 1)  # same tokenizer, other weights
    with pytest.raises(CheckpointError, match="another encoder"):
        RagIndex.open(built, other)
    retok = tmp_path / "retok"
    retok.mkdir()
    for f in tiny.iterdir():
        (retok / f.name).write_bytes(f.read_bytes())
    data = json.loads((retok / "tokenizer.json").read_text())
    data["normalizer"]["lowercase"] = not data["normalizer"]["lowercase"]
    (retok / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="another tokenizer"):
        RagIndex.open(built, retok)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["no-manifest", "bad-manifest", "no-chunks", "bad-faiss", "short-chunks",
                                    "no-generation", "not-index"])
def test_damaged_folder_is_one_clear_error(built, tmp_path, damage):
    from lmkit.cli import main

    folder = _copy(built, tmp_path / "ix")
    gen = next(folder.glob("gen-*"))
    if damage == "no-manifest":
        (folder / "manifest.json").unlink()
    elif damage == "bad-manifest":
        (folder / "manifest.json").write_text('{"format": "lmkit-rag-index", ')
    elif damage == "no-chunks":
        (gen / "chunks.json").unlink()
    elif damage == "bad-faiss":
        (gen / "vectors.faiss").write_bytes((gen / "vectors.faiss").read_bytes()[:100])
    elif damage == "short-chunks":
        data = json.loads((gen / "chunks.json").read_text())
        (gen / "chunks.json").write_text(json.dumps({k: v[:-1] for k, v in data.items()}))
    elif damage == "no-generation":
        import shutil

        shutil.rmtree(gen)
    else:
        (folder / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError):
        RagIndex.open(folder)
    assert main(["rag", "query", "--index", str(folder), "--query", "cats"]) == 2


def test_cli_errors_are_one_line(tmp_path, tiny, capsys):
    from lmkit.cli import main

    (tmp_path / "empty.txt").write_text("  \n\n ")
    assert main(["rag", "index", "--encoder", str(tiny), "--corpus", str(tmp_path / "empty.txt"),
                 "--out", str(tmp_path / "ix")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmkit: error:") and "\n" not in err and not (tmp_path / "ix").exists()
    assert main(["rag", "query", "--index", str(tmp_path / "nothing"), "--query", "x"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    (tmp_path / "doc.txt").write_text("Some text to index.")
    assert main(["rag", "index", "--encoder", str(tiny), "--corpus", str(tmp_path / "doc.txt"),
                 "--out", str(tmp_path / "full")]) == 2
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"


def test_a_failed_save_leaves_the_old_index(built, tmp_path, monkeypatch):
    folder = _copy(built, tmp_path / "ix")
    index = RagIndex.open(folder)
    before = [(h.source, h.text) for h in retrieve(index, "cats", 3)]
    index.add([Document("more", "Another document about cats and dogs.")])

    def broken(*_):
        raise OSError(28, "No space left on device", str(folder))

    monkeypatch.setattr(faiss, "write_index", broken)
    with pytest.raises(OSError):
        index.save(folder)
    monkeypatch.undo()
    assert [(h.source, h.text) for h in retrieve(RagIndex.open(folder), "cats", 3)] == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in built.iterdir())


def test_approximate_index_past_the_threshold(tiny):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    rng = np.random.default_rng(0)
    docs = [Document(f"d{i}", " ".join(rng.choice(words, 6))) for i in range(400)]
    exact = RagIndex.create(tiny, chunk_tokens=20, overlap=0)
    exact.add(docs)
    approx = RagIndex.create(tiny, chunk_tokens=20, overlap=0, approximate_above=300, nprobe=10**6)
    approx.add(docs[:200])
    assert not approx.approximate
    approx.add(docs[200:])
    assert approx.approximate and approx.index.nprobe == approx.index.nlist > 1
    # every list searched: the inverted file returns what exact search does
    for q in ("alpha beta", "sigma rho pi", "gamma"):
        a = [round(s, 5) for _, s in approx.dense(q, 10)]
        b = [round(s, 5) for _, s in exact.dense(q, 10)]
        assert a == b
    approx.remove(["d0", "d399"])
    approx.add([Document("late", "omega omega omega")])
    assert approx.index.ntotal == len(approx) == 399
    assert approx.dense("omega omega omega", 1)[0][0] == approx.documents["late"]["chunks"][0]


def test_rrf_is_the_sum_of_reciprocal_ranks():
    fused = dict(rrf([[1, 2, 3], [3, 1, 4]], k0=60))
    assert fused[1] == pytest.approx(1 / 61 + 1 / 62)
    assert fused[3] == pytest.approx(1 / 63 + 1 / 61)
    assert fused[4] == pytest.approx(1 / 63)
    assert [i for i, _ in rrf([[1, 2, 3], [3, 1, 4]])] == [1, 3, 2, 4]


def test_bad_mode_and_k(built):
    index = RagIndex.open(built)
    with pytest.raises(ConfigError):
        retrieve(index, "x", 5, "sparse")
    with pytest.raises(LmkitError):
        retrieve(index, "x", 0)


def test_query_json_is_one_list_best_first(built, capsys):
    from lmkit.cli import main

    for mode in ("dense", "bm25", "hybrid"):
        assert main(["rag", "query", "--index", str(built), "--query", "cats sleep at night", "--k", "3",
                     "--mode", mode, "--json"]) == 0
        out = capsys.readouterr().out
        hits = json.loads(out)
        assert out.count("\n") == 1 and isinstance(hits, list) and 1 <= len(hits) <= 3
        assert all(set(h) == {"source", "score", "text"} and isinstance(h["score"], float) for h in hits)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert hits[0]["source"] == "cats"


# parity with the reference libraries ----------------------------------------------------------------------

QUERIES = ["How do I read rows from a database?", "serialize python objects to text", "Ünïcödé café",
           "北京欢迎你", "path of a file on disk", "small animals that hunt at night", "x"]


@pytest.mark.parametrize("chunk_tokens, overlap, batch_size, n_docs", [(61, 9, 7, 6), (120, 10, 64, 14)])
def test_dense_parity_with_sentence_transformers_and_faiss(minilm_path, chunk_tokens, overlap, batch_size, n_docs):
    st = pytest.importorskip("sentence_transformers")
    from lmkit.data import load_corpus
    from lmkit.sentence import length_batches

    docs = DOCS + [d for d in load_corpus("pydocs") if 200 < len(d.text) < 1500][:n_docs]
    index = RagIndex.create(minilm_path, chunk_tokens=chunk_tokens, overlap=overlap, batch_size=batch_size)
    index.add(docs)
    ids = sorted(index.chunks)
    texts = [index.chunks[i].text for i in ids]
    lengths = sorted((len(t) for t in index.encoder.tokenize(texts)), reverse=True)
    batches = length_batches(list(range(len(lengths))), lengths, batch_size)
    assert [i for b in batches for i in b] == list(range(len(lengths))) and max(map(len, batches)) <= batch_size
    if batch_size == 64:  # long chunks of mixed lengths: batches are cut where the lengths spread, not every 64
        assert len(batches) > -(-len(lengths) // batch_size)
    model = st.SentenceTransformer(str(minilm_path), device="cpu")
    ref = faiss.IndexFlatIP(384)
    ref.add(model.encode(texts, batch_size=5, normalize_embeddings=True))
    q = model.encode(QUERIES, normalize_embeddings=True)
    scores, rows = ref.search(q, 10)
    for query, s, r in zip(QUERIES, scores, rows):
        got = index.dense(query, 10)
        assert [i for i, _ in got] == [ids[j] for j in r], query
        np.testing.assert_allclose([x for _, x in got], s, atol=2e-5)


def test_bm25_parity_with_bm25s(built):
    index = RagIndex.open(built)
    ids = sorted(index.chunks)
    ref = bm25s.BM25()
    ref.index(bm25s.tokenize([index.chunks[i].text for i in ids], stopwords="en", show_progress=False),
              show_progress=False)
    for query in QUERIES + ["cats cats kittens", "SQL statements rows"]:
        k = min(5, len(ids))
        rows, scores = ref.retrieve(bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False),
                                    k=k, show_progress=False)
        want = [(ids[r], float(s)) for r, s in zip(rows[0], scores[0]) if s > 0]
        assert [(i, pytest.approx(s)) for i, s in index.bm25(query, 5)] == want, query


def test_evalset_is_deterministic_and_not_a_copy():
    from lmkit.data import load_corpus
    from lmkit.rag import evalset

    docs = load_corpus("pydocs")
    corpus, queries = evalset.build(docs, 150, 60)
    again, queries2 = evalset.build(docs, 150, 60)
    assert corpus == again and queries == queries2 and len(queries) == 60
    by_id = {d.id: d.text for d in corpus}
    summaries = {e.name: e.summary for e in evalset.entries(docs)}
    for q in queries:
        text = by_id[q.relevant].lower()
        assert summaries[q.relevant].lower() not in text  # the summary is held out of the corpus
        assert q.text not in " ".join(text.split())       # nor is the query text found verbatim
        assert not any(p in q.text.split() for p in q.relevant.lower().split(".")[-1:])
        assert "_" not in q.text and "(" not in q.text
    assert evalset.rewrite("Return a new list of all items.", "x.build") == "give back a fresh sequence of every elements"
    s = evalset.scores([1, 3, None, 7])
    assert s == {"recall@1": 0.25, "recall@5": 0.5, "recall@10": 0.75, "mrr@10": pytest.approx((1 + 1 / 3 + 1 / 7) / 4)}
    assert evalset.rank_of("b", ["a", "b", "b"]) == 2 and evalset.rank_of("z", ["a"]) is None


def test_cli_index_updates_in_place_and_removes(tmp_path, tiny, capsys):
    from lmkit.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Cats sleep most of the day.")
    b.write_text("Zebras graze on the savanna.")
    base = ["rag", "index", "--encoder", str(tiny), "--out", str(tmp_path / "ix"), "--precision", "fp32",
            "--chunk-tokens", "20", "--overlap", "4"]
    assert main(base + ["--corpus", str(a)]) == 0
    assert main(base + ["--corpus", str(a), str(b)]) == 0
    assert "1 added, 0 replaced, 1 unchanged, 1 chunks embedded" in capsys.readouterr().err
    b.write_text("Zebras are striped and graze.")
    assert main(base + ["--corpus", str(b)]) == 0
    assert "0 added, 1 replaced" in capsys.readouterr().err
    assert main(base[:-4] + ["--chunk-tokens", "30", "--corpus", str(b)]) == 2
    assert "chunked with --chunk-tokens 20" in capsys.readouterr().err
    index = RagIndex.open(tmp_path / "ix")
    assert len(index.documents) == 2
    source_b = next(s for s in index.documents if "b" in Path(s).name)
    assert [h.text for h in retrieve(index, "zebras", 5, "bm25")] == ["Zebras are striped and graze."]
    assert main(["rag", "remove", "--index", str(tmp_path / "ix"), "--source", source_b]) == 0
    assert retrieve(RagIndex.open(tmp_path / "ix"), "zebras", 5, "bm25") == []
    assert main(["rag", "remove", "--index", str(tmp_path / "ix"), "--source", "nope"]) == 2


def test_length_batches_cut_long_mixed_rows_and_keep_short_ones_whole():
    from lmkit.sentence import length_batches

    short = [20] * 100  # short texts: full batches, as fixed batching gives
    assert [len(b) for b in length_batches(list(range(100)), short, 32)] == [32, 32, 32, 4]
    lengths = sorted(((i * 37) % 120 + 10 for i in range(300)), reverse=True)
    batches = length_batches(list(range(300)), lengths, 64)
    assert [i for b in batches for i in b] == list(range(300))
    padded = sum(lengths[b[0]] * len(b) for b in batches)
    fixed = sum(lengths[s] * len(lengths[s:s + 64]) for s in range(0, 300, 64))
    assert padded < fixed and all(len(b) <= 64 for b in batches)
    for b in batches:  # a batch spreads past 90% of its longest only while it is under 1024 padded tokens
        over = [j for j, i in enumerate(b) if lengths[i] < 0.9 * lengths[b[0]]]
        assert not over or over[0] * lengths[b[0]] < 1024
