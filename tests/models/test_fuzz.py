"""Hypothesis fuzzing: the config reader and the tokenizers raise nothing but lmkit's documented errors."""
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import lmkit
from lmkit.config import ModelConfig, get_preset
from lmkit.errors import LmkitError
from lmkit.hub import load_config

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.sampled_from([0, 1, 2, 3, 4, 8, 64]),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                         st.sampled_from(["gelu", "silu", "relu", "gelu_new", "rope", "linear", "llama3", "swiglu"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=8)


def _hf_configs():
    """Real config.json of each family (small sizes), as the base that the fuzzer mutates."""
    from lmkit.hub import _families

    bases = []
    for model_type, family in sorted(_families().items()):
        pattern = {"sparse": {"sparse_attention": "bigbird"}} if model_type == "big_bird" else {}
        for preset in ("tiny", "bert", "t5-small", "bart-base", "longformer-tiny"):
            try:
                cfg = get_preset(preset, family=model_type, **pattern)
                bases.append(family.config_to_hf(cfg))
                break
            except (LmkitError, TypeError, ValueError, KeyError, AttributeError):
                continue
    bases.append({"lmkit": get_preset("tiny").to_dict()})
    return bases


BASES = _hf_configs()


def _read(raw_bytes: bytes):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_bytes(raw_bytes)
        try:
            return load_config(d)[0]
        except LmkitError:
            return None


@FUZZ
@given(st.sampled_from(range(len(BASES))), st.lists(st.tuples(st.text(max_size=24), json_values), max_size=6),
       st.lists(st.integers(0, 60), max_size=3), st.data())
def test_mutated_config_json_reads_or_raises_a_documented_error(base, changes, drops, data):
    raw = json.loads(json.dumps(BASES[base]))
    target = raw["lmkit"] if "lmkit" in raw else raw
    keys = sorted(target)
    for i in drops:
        target.pop(keys[i % len(keys)], None)
    for key, value in changes:
        name = data.draw(st.sampled_from(keys)) if key == "" or key.isdigit() else key
        target[name] = value
    cfg = _read(json.dumps(raw, allow_nan=True).encode())
    if cfg is not None:  # what the reader accepts has the types and ranges the builders rely on
        assert isinstance(cfg, ModelConfig)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(cfg, name)
            assert isinstance(value, int) and not isinstance(value, bool) and value > 0, (name, value)


@FUZZ
@given(st.binary(max_size=200))
def test_config_json_bytes_read_or_raise_a_documented_error(blob):
    _read(blob)


@FUZZ
@given(st.sampled_from(range(len(BASES))), st.integers(0, 400))
def test_truncated_config_json(base, cut):
    text = json.dumps(BASES[base]).encode()
    _read(text[:cut])


# tokenizers -----------------------------------------------------------------------------------------

CORPUS = ["Hello, world! Ünïcödé text — with emoji 🙂 and 漢字.", "def f(x):\n    return x ** 2  # tabs\tand spaces",
          "The quick brown fox jumps over the lazy dog. " * 3, "数据 données データ", "a" * 50]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for kind in ("bpe", "wordpiece", "unigram"):
        tok = lmkit.train_tokenizer(CORPUS * 4, kind=kind, vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"])
        path = tmp_path_factory.mktemp(kind) / "tokenizer.json"
        tok.save(str(path))
        out[kind] = (lmkit.load_tokenizer(path), path)
    return out


texts = st.text(st.characters(codec="utf-8"), max_size=60)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["bpe", "wordpiece", "unigram"]), texts)
def test_encode_decode_never_crash_and_byte_level_bpe_is_lossless(tokenizers, kind, text):
    tok = tokenizers[kind][0]
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    decoded = tok.decode(ids)
    assert isinstance(decoded, str)
    if kind == "bpe":
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode_batch([text, text]) == [ids, ids]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["bpe", "wordpiece", "unigram"]), st.lists(st.integers(-5, 400), max_size=20))
def test_decoding_arbitrary_ids_returns_text_or_a_documented_error(tokenizers, kind, ids):
    tok = tokenizers[kind][0]
    try:
        assert isinstance(tok.decode(ids), str)
    except LmkitError:
        assume(any(not 0 <= i < tok.vocab_size for i in ids))  # only ids outside the vocabulary may be refused


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["bpe", "wordpiece", "unigram"]), st.integers(0, 10**6), st.binary(min_size=1, max_size=4),
       st.booleans())
def test_damaged_tokenizer_json_loads_or_raises_a_documented_error(tokenizers, tmp_path_factory, kind, where, junk, cut):
    raw = tokenizers[kind][1].read_bytes()
    pos = where % len(raw)
    blob = raw[:pos] if cut else raw[:pos] + junk + raw[pos + len(junk):]
    path = tmp_path_factory.mktemp("damaged") / "tokenizer.json"
    path.write_bytes(blob)
    try:
        tok = lmkit.load_tokenizer(path)
    except LmkitError:
        return
    tok.decode(tok.encode("hello world 🙂"))


@FUZZ
@given(json_values)
def test_tokenizer_json_of_any_shape_loads_or_raises_a_documented_error(value):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokenizer.json"
        path.write_text(json.dumps({"version": "1.0", "model": value} if not isinstance(value, dict) else value))
        try:
            lmkit.load_tokenizer(path)
        except LmkitError:
            pass
