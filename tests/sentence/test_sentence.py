"""SentenceEncoder against sentence-transformers: the real all-MiniLM-L6-v2 (shipped in a pip package)
and a small random model with other pooling modes, a Dense layer and no normalization."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lmkit
from lmkit.errors import ConfigError
from tolerances import resolution

st = pytest.importorskip("sentence_transformers")

SENTENCES = [
    "Hello, world!", "  leading and trailing spaces  ", "Ünïcödé café naïve — déjà vu", "北京欢迎你，日本語のテキストも。",
    "Привет, мир! Как дела?", "مرحبا بالعالم", "Ελληνικά κείμενα για δοκιμή", "हिन्दी में एक वाक्य", "한국어 문장입니다",
    "emoji 🤗 and symbols ∑∫√", "x", " ".join(["a sentence far longer than the maximum length of the model"] * 40),
    "The quick brown fox jumps over the lazy dog. " * 30,
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_all_minilm_matches_sentence_transformers(minilm_path):
    ref = st.SentenceTransformer(str(minilm_path), device="cpu").encode(SENTENCES, batch_size=5)
    enc = lmkit.SentenceEncoder.from_pretrained(minilm_path)
    assert enc.max_seq_length == 256 and enc.normalize and enc.pooling_modes == ("mean",)
    assert len(enc.tokenize(SENTENCES[-1:])[0]) == 256  # the long ones are cut at max_seq_length
    got = enc.encode(SENTENCES, batch_size=5)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    assert cosines(got, ref).min() >= 0.99999
    assert np.abs(got - ref).max() < 1e-4
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # batching and order do not matter: one at a time gives the same rows
    single = np.stack([enc.encode(s) for s in SENTENCES[:4]])
    assert np.abs(single - got[:4]).max() < 1e-5


@pytest.mark.bf16
def test_all_minilm_bfloat16_close(minilm_path):
    ref = lmkit.SentenceEncoder.from_pretrained(minilm_path).encode(SENTENCES[:6])
    got = lmkit.SentenceEncoder.from_pretrained(minilm_path, dtype=torch.bfloat16).encode(SENTENCES[:6])
    assert got.dtype == np.float32
    # unit vectors d apart have cosine 1 - |d|^2 / 2; |d| a few bf16 steps
    assert cosines(got, ref).min() > 1 - (6 * resolution(torch.bfloat16)) ** 2 / 2


def test_other_pooling_dense_and_no_normalize(minilm_path, tmp_path):
    from sentence_transformers import models

    word = _small_bert(tmp_path, minilm_path)
    pooling = models.Pooling(24, pooling_mode=("max", "cls", "mean_sqrt_len_tokens"))
    dense = models.Dense(72, 10, activation_function=torch.nn.Tanh())
    model = st.SentenceTransformer(modules=[word, pooling, dense], device="cpu")
    model.save(str(tmp_path / "st"))
    ref = model.encode(SENTENCES, batch_size=4)
    enc = lmkit.SentenceEncoder.from_pretrained(tmp_path / "st")
    assert not enc.normalize and enc.max_seq_length == 20 and enc.pooling_modes == ("max", "cls", "mean_sqrt_len_tokens")
    got = enc.encode(SENTENCES, batch_size=4)
    assert got.shape == (len(SENTENCES), 10)
    assert np.abs(got - ref).max() < 1e-5


def test_errors(tmp_path, minilm_path):
    with pytest.raises(lmkit.LmkitError):
        lmkit.SentenceEncoder.from_pretrained(tmp_path / "missing")
    enc = lmkit.SentenceEncoder.from_pretrained(minilm_path)
    with pytest.raises(ConfigError):
        enc.encode([b"bytes"])
    for bad in (None, 5):
        with pytest.raises(ConfigError, match="string or a list of strings"):
            enc.encode(bad)


def _kind(value) -> tuple:
    """What a result is: its type, shape and dtype (recursively for lists)."""
    if isinstance(value, list):
        return ("list", len(value), *(_kind(v) for v in value))
    return (type(value).__name__, tuple(value.shape), str(value.dtype))


@pytest.mark.parametrize("kw", [{}, {"convert_to_tensor": True}, {"convert_to_numpy": False},
                                {"convert_to_numpy": False, "convert_to_tensor": True},
                                {"output_value": "token_embeddings"}, {"precision": "ubinary"}, {"truncate_dim": 10}])
def test_result_kinds_match_sentence_transformers(minilm_path, kw):
    """The type, shape and dtype of encode's result equal sentence-transformers' for one string and a list; an
    empty list gives DESIGN's (N, dim) with N = 0 (sentence-transformers: np.array([]), (0,) float64)."""
    ref = st.SentenceTransformer(str(minilm_path), device="cpu")
    enc = lmkit.SentenceEncoder.from_pretrained(minilm_path)
    for texts in ("one text", ["one text"], ["one text", "and another"]):
        assert _kind(enc.encode(texts, **kw)) == _kind(ref.encode(texts, **kw)), (texts, kw)
    if kw in ({}, {"convert_to_tensor": True}, {"truncate_dim": 10}):
        empty, one = enc.encode([], **kw), enc.encode(["one text"], **kw)
        assert _kind(empty) == (_kind(one)[0], (0, one.shape[1]), _kind(one)[2])
    if not kw:  # an index of no passages holds (0, dim) embeddings and answers nothing
        from lmkit.search import SemanticIndex

        index = SemanticIndex.build(enc, [], [])
        assert index.embeddings.shape == (0, 384) and index.search("one text") == []


def test_pool_tokens_modes():
    from lmkit.sentence import SentenceEncoder, pool_tokens

    h = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = pool_tokens(h, mask, ("max", "weightedmean", "lasttoken"))
    torch.testing.assert_close(out[0, :3], h[0, :2].max(0).values)
    torch.testing.assert_close(out[0, 3:6], (h[0, 0] + 2 * h[0, 1]) / 3)
    torch.testing.assert_close(out[0, 6:], h[0, 1])
    torch.testing.assert_close(out[1, 6:], h[1, 3])
    legacy = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}
    assert SentenceEncoder._pooling_modes(legacy) == ("cls", "mean")  # the legacy concatenation order
    with pytest.raises(ConfigError):
        SentenceEncoder._pooling_modes({"pooling_mode": "median"})


def test_top_k_ranks_by_cosine():
    from lmkit.sentence import top_k

    emb = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [-1.0, 0.0]])
    hits = top_k(np.array([1.0, 0.1]), emb, k=3)
    assert [i for i, _ in hits] == [0, 2, 1]
    assert hits[0][1] == pytest.approx(1 / np.sqrt(1.01))
    assert len(top_k(np.array([1.0, 0.0]), emb, k=10)) == 4


def test_semantic_search_cli_finds_the_right_paragraph(minilm_path, tmp_path, monkeypatch, capsys):
    import json

    from lmkit.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    docs = {"cooking": "How to bake bread.\n\nMix flour, water, yeast and salt, knead the dough and let it rise.",
            "sports": "The football match ended in a draw after extra time and a penalty shoot-out.",
            "python": "A list comprehension builds a new list by applying an expression to each item."}
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()), encoding="utf-8")
    args = ["search", "--model", str(minilm_path), "--corpus", str(corpus), "--min-chars", "30", "--top-k", "2",
            "--json", "--query", "making a loaf at home", "who won the soccer game"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["hits"][0]["id"] == "cooking#1" and lines[1]["hits"][0]["id"].startswith("sports")
    assert len(lines[0]["hits"]) == 2 and lines[0]["hits"][0]["score"] >= lines[0]["hits"][1]["score"]
    assert main(args) == 0  # from the cached index
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines


def _small_bert(tmp_path, minilm_path):
    """A random 2-layer BERT of width 24 with MiniLM's tokenizer, as a sentence-transformers Transformer module."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=40, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "bert" / name).write_bytes((minilm_path / name).read_bytes())
    return st.models.Transformer(str(tmp_path / "bert"), max_seq_length=20)


def test_module_order_normalize_flag_and_gelu(minilm_path, tmp_path):
    """Normalize before a Dense runs there; normalize_embeddings=False keeps the model's Normalize (as ST)."""
    from sentence_transformers import models
    word = _small_bert(tmp_path, minilm_path)
    mods = [word, models.Pooling(24), models.Normalize(), models.Dense(24, 8, activation_function=torch.nn.GELU())]
    st.SentenceTransformer(modules=mods, device="cpu").save(str(tmp_path / "a"))
    st.SentenceTransformer(modules=[word, models.Pooling(24), models.Normalize()], device="cpu").save(str(tmp_path / "b"))
    for name, kw in (("a", {}), ("a", {"normalize_embeddings": True}), ("b", {"normalize_embeddings": False})):
        ref = st.SentenceTransformer(str(tmp_path / name), device="cpu").encode(SENTENCES, batch_size=4, **kw)
        got = lmkit.SentenceEncoder.from_pretrained(tmp_path / name).encode(SENTENCES, batch_size=4, **kw)
        assert np.abs(got - ref).max() < 1e-5, (name, kw)


def test_do_lower_case_and_prompts(minilm_path, tmp_path):
    import json

    from sentence_transformers import models
    st.SentenceTransformer(modules=[_small_bert(tmp_path, minilm_path), models.Pooling(24)], device="cpu").save(str(tmp_path / "m"))
    folder = tmp_path / "m"
    cfg = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**cfg, "do_lower_case": True}))
    stc = json.loads((folder / "config_sentence_transformers.json").read_text())
    stc.update(prompts={"query": "query: ", "doc": ""}, default_prompt_name="query")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(stc))
    texts = SENTENCES + ["ΣΊΣΥΦΟΣ ΟΔΟΣ", "İstanbul"]  # final sigma: the tokenizer lowercases letter by letter
    ref_model, enc = st.SentenceTransformer(str(folder), device="cpu"), lmkit.SentenceEncoder.from_pretrained(folder)
    for kw in ({}, {"prompt_name": "doc"}, {"prompt": "passage: "}):
        assert np.abs(enc.encode(texts, batch_size=4, **kw) - ref_model.encode(texts, batch_size=4, **kw)).max() < 1e-5, kw
    with pytest.raises(ConfigError, match="nope"):
        enc.encode(["x"], prompt_name="nope")
    assert enc.encode(["x"], prompt="").shape == (1, 24)


def test_show_progress_bar_draws_batches_on_a_terminal_only(minilm_path, monkeypatch):
    """show_progress_bar=True: one "Batches" bar over ceil(N / batch_size) steps (as sentence-transformers), drawn
    when stderr is a terminal; off otherwise, and the embeddings are the same either way."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    enc = lmkit.SentenceEncoder.from_pretrained(minilm_path)
    plain = enc.encode(SENTENCES[:5], batch_size=2)
    for show, tty in ((True, True), (False, True), (True, False)):
        err = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        got = enc.encode(SENTENCES[:5], batch_size=2, show_progress_bar=show)
        assert np.array_equal(got, plain)
        assert ("Batches" in err.getvalue() and "3/3" in err.getvalue()) == (show and tty)
