"""Token shards: prepare (serial and parallel), the index, memory-mapped reading, rows per rank."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import lmkit
from lmkit.data import prepare as prep
from lmkit.data.corpus import chunk_text, paragraphs, read_jsonl
from lmkit.data.documents import split_hash
from lmkit.data.shards import ShardDataset, ShardStream, read_header, token_dtype

SPECIAL = ["<|endoftext|>", "<|pad|>"]


def _texts(n=60):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu café naïve 数据 🙂".split()
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 80)))) + f" doc {i}." for i in range(n)]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    texts = _texts()
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"d{i}", "text": t}) + "\n")
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=300, special_tokens=SPECIAL)
    tok.save(str(root / "tok.json"))
    return root, texts


def test_token_dtype_follows_vocabulary():
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_prepare_round_trip(corpus_dir):
    root, texts = corpus_dir
    index = prep.prepare([str(root / "corpus.jsonl")], root / "tok.json", root / "out", workers=1,
                         val_fraction=0.2, shard_bytes=600)
    tok = lmkit.load_tokenizer(root / "tok.json")
    ds = ShardDataset(root / "out")
    assert ds.dtype == "uint16" and len(index["splits"]["train"]["shards"]) > 2  # small shard_bytes: several shards
    expect = {"train": [], "validation": []}
    for i, t in enumerate(texts):  # the split rule of Corpus.split, by id hash
        expect["validation" if split_hash(f"d{i}") < 0.2 else "train"].append(t)
    for name, want in expect.items():
        split = ds.split(name)
        docs = list(split.documents())
        assert [ids.tolist() for ids, _ in docs] == [tok.encode(t, add_special_tokens=False) for t in want]
        assert [n for _, n in docs] == [len(t.encode("utf-8")) for t in want]
        stream = split[0:split.num_tokens]  # one stream across shards: sep d_1 sep d_2 ...
        assert stream.tolist() == [x for t in want for x in [0] + tok.encode(t, add_special_tokens=False)]
        assert split.num_tokens == index["splits"][name]["num_tokens"]
    header, start = read_header(root / "out" / index["splits"]["train"]["shards"][0]["file"])
    assert header["tokens"]["dtype"] == "U16"


def test_parallel_prepare_is_byte_identical(corpus_dir):
    root, _ = corpus_dir
    a = prep.prepare([str(root / "corpus.jsonl")], root / "tok.json", root / "serial", workers=1, shard_bytes=500)
    b = prep.prepare([str(root / "corpus.jsonl")], root / "tok.json", root / "parallel", workers=2, shard_bytes=500)
    assert a["splits"] == b["splits"]
    for e in a["splits"]["train"]["shards"]:
        assert (root / "serial" / e["file"]).read_bytes() == (root / "parallel" / e["file"]).read_bytes()


def test_uint32_when_the_vocabulary_does_not_fit_16_bits(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70000)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tok.json"))
    (tmp_path / "c.txt").write_text("w69999 w3 w65536\n\nw65537 w0 w69998 w70000", encoding="utf-8")
    index = prep.prepare([str(tmp_path / "c.txt")], tmp_path / "tok.json", tmp_path / "out", workers=1, val_fraction=0)
    assert index["dtype"] == "uint32"
    split = ShardDataset(tmp_path / "out").split("train")
    assert split.shards[0].tokens.dtype == np.uint32
    assert split[0:split.num_tokens].tolist() == [0, 70001, 5, 65538, 65539, 2, 70000, 1]


def test_rows_are_slices_of_the_stream_and_ranks_split_the_global_batch(corpus_dir):
    root, _ = corpus_dir
    prep.prepare([str(root / "corpus.jsonl")], root / "tok.json", root / "rows", workers=1, shard_bytes=700)
    split = ShardDataset(root / "rows").split("train")
    full = split[0:split.num_tokens]
    stream = ShardStream(split, seq_len=16)
    rows = stream.rows(seed=3, step=5, batch_size=6)
    starts = [j * 16 for j in stream.row_indices(3, 30, 6)]
    assert rows.tolist() == [full[s:s + 17].tolist() for s in starts]  # rows may cross shard boundaries
    parts = [stream.rows(3, 5, 6, rank=r, world_size=3) for r in range(3)]
    assert np.array_equal(np.concatenate(parts), rows.numpy())
    again = ShardStream(ShardDataset(root / "rows").split("train"), 16)  # a fresh reader (a resumed run)
    assert np.array_equal(again.rows(3, 5, 6).numpy(), rows.numpy())
    # one epoch visits every row exactly once, the next one in another order
    epoch0 = stream.row_indices(3, 0, stream.num_rows)
    epoch1 = stream.row_indices(3, stream.num_rows, stream.num_rows)
    assert sorted(epoch0) == list(range(stream.num_rows)) == sorted(epoch1) and epoch0 != epoch1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "\n", "\n\n", "é", "数", " ", "\r\n", "🙂"]), max_size=60),
       st.integers(1, 9), st.integers(2, 30))
def test_streamed_reading_equals_whole_file_reading(tmp_path_factory, parts, block, max_chars):
    path = tmp_path_factory.mktemp("s") / "t.txt"
    text = "".join(parts)
    path.write_bytes(text.encode("utf-8"))
    old = prep.BLOCK
    prep.BLOCK = block  # tiny blocks: paragraph and UTF-8 boundaries fall across reads
    try:
        assert list(prep.stream_paragraphs(path, max_chars)) == list(paragraphs(text, max_chars))
        got = list(prep.stream_text_file(path, "L", max_chars))
    finally:
        prep.BLOCK = old
    assert [(d.id, d.text) for d in got] == [(f"L#{i}", t) for i, t in enumerate(chunk_text(text, max_chars))]


def test_streamed_jsonl_equals_read_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "id": 7}\n{"text": "   "}\n{"text": "x\\u2028y"}', encoding="utf-8")
    old = prep.BLOCK
    prep.BLOCK = 5
    try:
        got = list(prep.stream_jsonl(path, "L"))
    finally:
        prep.BLOCK = old
    assert got == read_jsonl(path, "L")


def test_stream_documents_matches_load_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("para one\n\npara two\n\n" * 300, encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n', encoding="utf-8")
    specs = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    assert list(prep.stream_documents(specs)) == lmkit.data.load_corpus(specs).documents


@pytest.mark.parametrize("sep", ["\n", " "])
def test_text_without_blank_lines_streams_in_bounded_memory(tmp_path, sep):
    """A file of one paragraph (lines, or one huge line) used to be one document held whole: memory
    grew with the file (1.5 GB for 48 MB of lines) and every block re-copied it. It is cut into documents of
    at most CHUNK_CHARS at line breaks (else spaces), and reading holds about a block."""
    import tracemalloc

    words = [f"word{i % 97}" for i in range(300_000)]  # 2 MB
    path = tmp_path / "one_paragraph.txt"
    path.write_text(sep.join(words), encoding="utf-8")
    old = prep.BLOCK
    prep.BLOCK = 1 << 16
    tracemalloc.start()
    try:
        docs = [len(d.text) for d in prep.stream_text_file(path, "L")]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        prep.BLOCK = old
    assert peak < 1 << 20, peak
    assert max(docs) <= prep.CHUNK_CHARS and sum(docs) > 2_000_000
    texts = [d.text for d in prep.stream_text_file(path, "L")]
    assert texts == chunk_text(path.read_text(encoding="utf-8"))
    assert " ".join(t.replace("\n", " ") for t in texts).split() == words  # every word kept, in order


def test_prepare_refuses_an_out_the_corpus_would_read(corpus_dir, tmp_path):
    """Shards written inside a corpus folder (or matched by a corpus glob) would be read as text by the next
    prepare or train on that corpus: refused up front, nothing written."""
    from lmkit.errors import CorpusError

    root, _ = corpus_dir
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n\nmore text\n", encoding="utf-8")
    (folder / "b.json").write_text('{"text": "json text"}\n', encoding="utf-8")
    for corpus, out, match in (([str(folder)], folder / "shards", "inside the corpus folder"),
                               ([str(tmp_path / "**" / "*.json")], tmp_path / "data", "would match --corpus")):
        with pytest.raises(CorpusError, match=match):
            prep.prepare(corpus, root / "tok.json", out, workers=1)
        assert not out.exists()
