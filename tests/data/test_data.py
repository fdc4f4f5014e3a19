"""Corpora: built-in pydocs/pycode, user files, errors, and the deterministic split."""
import json
import random

import pytest

from lmkit.data import Corpus, Document, load_corpus
from lmkit.data.builtin import BUILTIN, builtin_corpus
from lmkit.data.corpus import chunk_text
from lmkit.data.documents import split_hash
from lmkit.errors import CorpusError, LmkitError


def make_corpus(n, prefix="d"):
    return Corpus("t", [Document(f"{prefix}{i}", f"text {i}") for i in range(n)])


# the split ----------------------------------------------------------------------------------

def test_split_is_a_function_of_the_document_id_alone():
    corpus = make_corpus(400)
    train, val = corpus.split(0.1)
    val_ids = {d.id for d in val}
    assert val_ids == {d.id for d in corpus if split_hash(d.id) < 0.1}
    shuffled = Corpus("t", random.Random(0).sample(corpus.documents, len(corpus)))
    assert {d.id for d in shuffled.split(0.1)[1]} == val_ids            # order does not matter
    assert {d.id for d in corpus.head(200).split(0.1)[1]} == {i for i in val_ids if int(i[1:]) < 200}
    assert len(train) + len(val) == 400 and not ({d.id for d in train} & val_ids)
    assert 20 <= len(val) <= 60                                         # about 10% of 400


def test_split_keeps_both_sides_non_empty_and_needs_two_documents():
    train, val = make_corpus(2).split(0.05)
    assert len(train) == 1 and len(val) == 1
    with pytest.raises(CorpusError, match="at least two"):
        make_corpus(1).split()
    with pytest.raises(CorpusError):
        make_corpus(5).split(1.5)


def test_split_hash_is_documented_sha256_prefix():
    import hashlib

    u = int.from_bytes(hashlib.sha256(b"lmkit-split-v1:doc:json").digest()[:8], "big")
    assert split_hash("doc:json") == u / 2**64


# built-in corpora ---------------------------------------------------------------------------

def test_pydocs_holds_topics_and_stdlib_docstrings_but_no_tests():
    corpus = load_corpus("pydocs")
    ids = {d.id for d in corpus}
    assert "topic:with" in ids and "doc:json" in ids and "doc:collections" in ids
    assert not any(i.startswith(("doc:test.", "doc:unittest.test")) or ".tests." in i for i in ids)
    json_doc = next(d for d in corpus if d.id == "doc:json")
    assert "json.dumps\nSerialize ``obj`` to a JSON formatted ``str``." in json_doc.text
    train, val = corpus.split()
    assert len(val) >= 10 and train.num_bytes > 1_000_000


def test_builtin_corpus_is_deterministic_and_cached_atomically(tmp_path, monkeypatch):
    usual = load_corpus("pydocs")  # from the user's cache, built by another process
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = builtin_corpus("pydocs")
    assert built.fingerprint() == usual.fingerprint()
    files = list((tmp_path / "lmkit" / "corpora").iterdir())
    assert [f.suffix for f in files] == [".json"]                       # no temp files left behind
    calls = []
    monkeypatch.setitem(BUILTIN, "pydocs", lambda: calls.append(1) or [Document("x", "y")])
    assert builtin_corpus("pydocs").fingerprint() == built.fingerprint() and not calls   # read from the cache
    files[0].write_text("{ damaged")                                     # a damaged cache is rebuilt
    assert [d.text for d in builtin_corpus("pydocs")] == ["y"] and calls == [1]
    assert json.loads(files[0].read_text())["documents"] == [["x", "y"]]
    files[0].write_text(json.dumps({"name": "pydocs", "documents": [["x", "edited"]]}))  # valid JSON, wrong content
    assert [d.text for d in builtin_corpus("pydocs")] == ["y"] and calls == [1, 1]


def test_pycode_is_stdlib_source():
    corpus = load_corpus("pycode")
    doc = next(d for d in corpus if d.id == "src:json.decoder")
    assert "class JSONDecoder" in doc.text
    compile(doc.text, "json/decoder.py", "exec")


# user text ------------------------------------------------------------------------------------

def test_text_files_globs_folders_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\n\nsecond one\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("héllo wörld ✓", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": "x"}) + "\n"
                                      + json.dumps({"text": "   "}) + "\n", encoding="utf-8")
    corpus = load_corpus([str(tmp_path / "a.txt"), str(tmp_path / "sub"), str(tmp_path / "*.jsonl")])
    assert [d.text for d in corpus] == ["first paragraph\n\nsecond one\n", "héllo wörld ✓", "one", "two"]
    assert corpus.documents[3].id == "x"
    assert corpus.documents[2].id.endswith("c.jsonl:1")


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffhello".encode("utf-8"))
    (tmp_path / "bom.jsonl").write_bytes("\ufeff".encode("utf-8") + json.dumps({"text": "one"}).encode("utf-8"))
    assert [d.text for d in load_corpus([str(tmp_path / "bom.txt"), str(tmp_path / "bom.jsonl")])] == ["hello", "one"]


def test_chunking_cuts_only_at_blank_lines():
    paras = [f"paragraph {i} " + "x" * (i * 37 % 500) for i in range(60)]
    text = "\n\n".join(paras)
    chunks = chunk_text(text, max_chars=1000)
    assert "\n\n".join(chunks) == text and len(chunks) > 5
    assert all(len(c) <= 1000 or "\n\n" not in c for c in chunks)


@pytest.mark.parametrize("content, message", [
    (b"caf\xe9 au lait", "not UTF-8"),
    (b"   \n\n  ", "empty"),
])
def test_bad_files_raise_corpus_error(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(CorpusError, match=message):
        load_corpus(str(path))


def test_missing_paths_and_bad_jsonl(tmp_path):
    with pytest.raises(CorpusError, match="neither a built-in corpus"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(CorpusError, match="no files match"):
        load_corpus(str(tmp_path / "*.txt"))
    with pytest.raises(CorpusError, match="no corpus"):
        load_corpus([])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match="line 2"):
        load_corpus(str(bad))
    bad.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(CorpusError, match="line 2 is not JSON"):
        load_corpus(str(bad))
    assert issubclass(CorpusError, LmkitError)


def test_a_cached_tokenizer_without_the_special_tokens_is_retrained(tmp_path, monkeypatch):
    from lmkit.data.tokenize import SPECIAL_TOKENS, corpus_tokenizer
    from lmkit.tokenizers import train_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    corpus = Corpus("toy", [Document(str(i), f"def f{i}(x): return x * {i}\n") for i in range(40)])
    first = corpus_tokenizer(corpus, 300)
    (cached,) = (tmp_path / "lmkit" / "tokenizers").iterdir()
    train_tokenizer(corpus.texts(), kind="bpe", vocab_size=300, special_tokens=[]).save(str(cached))  # lacks them
    again = corpus_tokenizer(corpus, 300)
    assert all(again.token_to_id(t) is not None for t in SPECIAL_TOKENS)
    assert again.encode("def f7(x)") == first.encode("def f7(x)")
