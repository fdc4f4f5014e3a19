"""SentencePiece-converted tokenizer.json files (T5, ALBERT, XLNet, Llama, and transformers' generic SentencePiece
pipeline), run side by side with Hugging Face `tokenizers`: small SentencePiece models are trained here on
generated Unicode-rich text, converted by transformers' own slow->fast converters, and compared on ids, tokens and
decoded text; the Precompiled normalizer is also compared character by character."""
import base64
import importlib
import json
import random
import types

import pytest

tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")
from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: E402
from tokenizers import normalizers as N  # noqa: E402
from tokenizers import processors as R  # noqa: E402
# the module, not transformers' function of the same name
C = importlib.import_module("transformers.convert_slow_tokenizer")

from lmkit.errors import TokenizerError  # noqa: E402
from lmkit.tokenizers import tokenizer_from_json  # noqa: E402
from lmkit.tokenizers.normalizers import normalizer_from_json  # noqa: E402
from lmkit.tokenizers.precompiled import charsmap  # noqa: E402

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "naïve", "café", "Ångström", "straße", "ﬁnance", "①②",
         "㎏", "™", "…", "北京", "東京", "欢迎", "한국어", "한글", "مرحبا", "العالم", "Привет", "мир", "😀", "👍🏽",
         "👩‍👩‍👧", "Ｆｕｌｌ", "ｗｉｄｔｈ", "１２３", "e\u0301", "a\u0308", "नमस्ते", "ক্ষ", "ﾊﾝｶｸ", "ｶﾞ", "x²", "½",
         "Ⅻ", "don't", "3.14", "$5", "a\u00a0b", "tab\there", "«quote»", "ΟΔΥΣΣΕΥΣ", "İstanbul", "ǅemal"]
TEXTS = [
    "Hello, World! Ｆｕｌｌｗｉｄｔｈ ＡＢＣ１２３ ﬁnance ﬂow ① ㎏ ™ … ½ x² Ⅻ ㍻ ℃",
    "e\u0301 a\u0308 Ａ\u0301 ﬁ\u0301 \u1100\u1161\u11a8 한국어 北京 東京 ﾊﾝｶｸ ｶﾞ",
    "مرحبا بالعالم  Привет мир  नमस्ते क्ष a\u094d\u0915",
    "😀👍🏽 👩‍👩‍👧 🇫🇷🇩 👨🏿‍🦱 ©\u200d",
    "a\u00a0b\u2003c\u3000d\u200be\u2028f\ufeffg\u1680h",
    "tab\there\nnew\r\nline\x00nul\x01\x7f\x85\x9f end",
    "", " ", "   ", "a    b", "  leading and trailing  ", "▁already▁▁metaspace", "x\u0301y\u0308z\u0345\u0340",
    "ΟΔΥΣΣΕΥΣ straße ǅ ẞ İ", "don't ``quoted'' 3.14 $5", "[CLS] hello [SEP] <sep> </s> <s> <unk>", "\ufffd\ue000",
    "\x01hello", "\u0301\u0301accent first", "\u200b zero width", "\t\ttics", "\n",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]


def _train(tmp_path, name: str, **kw) -> str:
    """A small SentencePiece model trained on the generated corpus; returns its path."""
    options = dict(model_type="unigram", vocab_size=500, hard_vocab_limit=False, character_coverage=1.0,
                   minloglevel=2, num_threads=1)
    options.update(kw)
    prefix = str(tmp_path / name)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=prefix, **options)
    return prefix + ".model"


def _proto(path: str):
    proto = model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _original(path: str, **attrs):
    """What transformers' converters read from a slow tokenizer."""
    sp = spm.SentencePieceProcessor(model_file=path)
    base = dict(vocab_file=path, legacy=True, add_prefix_space=True, keep_accents=False, do_lower_case=True,
                _extra_ids=3, convert_tokens_to_ids=sp.piece_to_id, convert_ids_to_tokens=sp.id_to_piece)
    return types.SimpleNamespace(**{**base, **attrs})


def _generic(path: str, legacy: bool = True):
    """transformers' pipeline that follows the model's own normalizer spec (encodes like SentencePiece)."""
    proto = _proto(path)
    if proto.trainer_spec.model_type == 2:  # BPE: merges derived from the piece scores
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    else:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    return C.SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=legacy)


def _llama(path: str, legacy: bool):
    """Llama's SentencePiece BPE: the BPE model of the generic pipeline with LlamaConverter's normalizer,
    pre-tokenizer and decoder (its own `tokenizer()` cannot extract BPE merges in this transformers)."""
    tok = _generic(path)
    conv = C.LlamaConverter.__new__(C.LlamaConverter)
    conv.original_tokenizer = _original(path, legacy=legacy)
    tok.normalizer = conv.normalizer(None)  # Prepend + Replace (legacy) or none
    tok.pre_tokenizer = conv.pre_tokenizer("▁", True)
    tok.decoder = conv.decoder("▁", True)
    tok.post_processor = R.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    tsv = tmp / "rules.tsv"
    # custom rules: ﬁ -> "fi", "x y" -> "Z", Å deleted, "ab" -> "Q" (a key made of two graphemes)
    tsv.write_text("FB01\t66 69\n78 79\t5A\nC5\t\n61 62\t51\n", encoding="utf-8")
    out = {f"unigram-{rule}": _train(tmp, f"u_{rule}", normalization_rule_name=rule)
           for rule in ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "identity")}
    out.update({f"bpe-{rule}": _train(tmp, f"b_{rule}", model_type="bpe", normalization_rule_name=rule)
                for rule in ("nmt_nfkc", "nmt_nfkc_cf", "identity")})
    out["unigram-tsv"] = _train(tmp, "u_tsv", normalization_rule_tsv=str(tsv))
    # byte fallback: the rarest characters are left out of the vocabulary
    rare = dict(byte_fallback=True, character_coverage=0.98)
    out["unigram-bytes"] = _train(tmp, "u_bytes", user_defined_symbols=["<sep>", "▁hello"], **rare)
    out["bpe-bytes"] = _train(tmp, "b_bytes", model_type="bpe", **rare)
    out["bpe-nodummy"] = _train(tmp, "b_nodummy", model_type="bpe", add_dummy_prefix=False,
                                remove_extra_whitespaces=False, **rare)
    out["t5"] = _train(tmp, "t5", pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    out["albert"] = _train(tmp, "albert", pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                           control_symbols=["[CLS]", "[SEP]", "[MASK]"])
    out["xlnet"] = _train(tmp, "xlnet", unk_id=0, bos_id=1, eos_id=2, control_symbols=["<cls>", "<sep>"])
    return out


PIPELINES = {
    "t5": lambda m: C.T5Converter(_original(m["t5"])).converted(),
    "albert": lambda m: C.AlbertConverter(_original(m["albert"])).converted(),
    "albert-cased": lambda m: C.AlbertConverter(_original(m["albert"], keep_accents=True,
                                                          do_lower_case=False)).converted(),
    "xlnet": lambda m: C.XLNetConverter(_original(m["xlnet"])).converted(),
    "t5-unigram-nonlegacy": lambda m: C.T5Converter(_original(m["unigram-nmt_nfkc_cf"], legacy=False)).converted(),
    "llama-bpe": lambda m: _llama(m["bpe-bytes"], legacy=True),
    "llama-bpe-nonlegacy": lambda m: _llama(m["bpe-bytes"], legacy=False),
    # prepend_scheme "first" after a normalizer that strips the leading spaces
    "spm-unigram-nonlegacy": lambda m: _generic(m["unigram-nmt_nfkc"], legacy=False),
    "spm-bpe-nonlegacy": lambda m: _generic(m["bpe-bytes"], legacy=False),
    **{f"spm-{k}": (lambda k: lambda m: _generic(m[k]))(k) for k in (
        "unigram-nmt_nfkc", "unigram-nfkc", "unigram-nmt_nfkc_cf", "unigram-identity", "unigram-tsv",
        "unigram-bytes", "bpe-nmt_nfkc", "bpe-nmt_nfkc_cf", "bpe-identity", "bpe-bytes", "bpe-nodummy")},
}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def pipeline(request, models):
    hf = PIPELINES[request.param](models)
    d = json.loads(hf.to_str())
    return request.param, tokenizers.Tokenizer.from_str(json.dumps(d)), tokenizer_from_json(d), d


def test_converted_pipelines_match_hf(pipeline):
    name, hf, ours, _ = pipeline
    for text in TEXTS:
        for special in (True, False):
            enc = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == enc.ids, (name, text, special)
        assert ours.tokenize(text) == hf.encode(text, add_special_tokens=False).tokens, (name, text)
        ids = hf.encode(text).ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (name, text)
    for a, b in [(TEXTS[0], TEXTS[2]), (TEXTS[3], ""), (TEXTS[13], TEXTS[14])]:
        enc, mine = hf.encode(a, b), ours.encode_plus(a, pair=b)
        assert (mine.ids, mine.type_ids, mine.special_tokens_mask) == (enc.ids, enc.type_ids, enc.special_tokens_mask)


def test_converted_pipelines_round_trip(pipeline, tmp_path):
    """lmkit writes back the JSON it read, charsmap included, and `tokenizers` loads it to the same ids."""
    name, hf, ours, d = pipeline
    assert ours.to_json()["normalizer"] == d["normalizer"], name
    back = tokenizers.Tokenizer.from_file(ours.save(tmp_path / "tokenizer.json"))
    assert [back.encode(t).ids for t in TEXTS] == [hf.encode(t).ids for t in TEXTS], name


# where SentencePiece itself differs from `tokenizers`: HF walks the text by grapheme clusters and takes the
# *shortest* key of a cluster under 6 bytes for the whole cluster (TEXTS[1]: Ａ + accent, e + accent...; TEXTS[5]:
# "\r\n" is one cluster, so one space, not two), never a key spanning two clusters (the TSV's "ab"), and
# HF isolates control pieces such as </s> written in the text (TEXTS[15])
SPM_DIFFERS = {1, 5, 15}


@pytest.mark.parametrize("name", ["unigram-nmt_nfkc", "unigram-nfkc", "unigram-nmt_nfkc_cf", "unigram-identity",
                                  "unigram-tsv", "unigram-bytes", "bpe-nmt_nfkc", "bpe-identity", "bpe-bytes",
                                  "bpe-nodummy"])
def test_generic_pipeline_encodes_like_sentencepiece(models, name):
    sp = spm.SentencePieceProcessor(model_file=models[name])
    ours = tokenizer_from_json(json.loads(_generic(models[name]).to_str()))
    for i, text in enumerate(TEXTS):
        if i not in SPM_DIFFERS:
            ids = sp.encode(text)
            assert ours.encode(text) == ids, (name, text)
            if sp.unk_id() not in ids:  # SentencePiece decodes unk as " ⁇ ", HF as the piece
                assert ours.decode(ids) == sp.decode(ids), (name, text)


def _charsmap(rules: dict[str, str]) -> bytes:
    """A precompiled_charsmap compiled by SentencePiece from explicit rules."""
    spec = model_pb2.NormalizerSpec()
    spec.ParseFromString(spm.SentencePieceNormalizer(
        norm_map=list(rules.items()), add_dummy_prefix=False, escape_whitespaces=False,
        remove_extra_whitespaces=False).serialized_normalizer_spec())
    return spec.precompiled_charsmap


def _precompiled(blob: bytes):
    return normalizer_from_json({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(blob).decode()})


def test_precompiled_takes_the_shortest_key_of_a_short_cluster():
    """HF's rule, not SentencePiece's longest match: a cluster under 6 bytes whose first character is a key
    becomes that key's replacement whole (the accent of "e" + U+0301 is lost); a longer cluster goes character by
    character; keys spanning clusters never match; a replacement may be empty or longer than its key."""
    blob = _charsmap({"e": "E", "e\u0301": "É", "xy": "Z", "x": "Q", "Å": "", "①": "(1)", "\u0915": "k",
                      "\u0301": "'"})
    hf, ours = N.Precompiled(blob), _precompiled(blob)
    cases = {"e\u0301": "E", "e\u0301\u0301\u0301": "E'''", "xy": "Qy", "Åb": "b", "①①": "(1)(1)", "a\u0301": "a'",
             "\u0915\u094d\u0915": "k\u094dk", "\u0915\u0301": "k", "x\r\ne\n": "Q\r\nE\n", "": ""}
    for text, want in cases.items():
        assert ours.normalize(text) == hf.normalize_str(text) == want, text


POOL = ("a A Ａ e ﬁ ① x \u1100 \u1161 \u11a8 \uac00 \uac01 \u0600 \u06dd \u0890 \u0d4e \U000110bd \u0915 \u094d "
        "\u0937 \u093c \u0958 \u09cd \u0995 \u0d4d \u0d15 \u1b44 \ua9c0 \r \n \t \x00 \x01 \x7f \x85 \u200b \u200c "
        "\u200d \ufeff \ufe0f \U0001f3fd \U0001f468 \U0001f467 \u2764 \u00a9 \U0001f1eb \U0001f1f7 \u0300 \u0301 "
        "\u0308 \u0345 \u0340 \u093f \u0903 \u0e33 \u0e40 \u3099 \uff76 \uff9e ω Å \u212b \u00a0 \u3000 \u2581 "
        "\U000e0020 \U000e007f \u0b53 \u05c8 \u1cf5 \U00011a3a \u1ade").split() + [" "]


def test_precompiled_grapheme_clusters_match_hf():
    """Every character a key: a cluster under 6 bytes gives one character out, a longer one one per character, so
    the output shows where HF's grapheme segmentation (UAX #29, GB9c conjuncts, its Unicode version) cuts."""
    blob = _charsmap({c: "y" if c == "x" else "x" for c in POOL if c != "\x00"})  # NUL ends a C string
    hf, ours = N.Precompiled(blob), _precompiled(blob)
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(POOL) for _ in range(rng.randint(1, 7)))
        assert ours.normalize(text) == hf.normalize_str(text), [hex(ord(c)) for c in text]


@pytest.mark.parametrize("rule", ["nmt_nfkc", "nmt_nfkc_cf"])
def test_precompiled_matches_hf_on_every_character(models, rule):
    """Each BMP character and every 31st astral one alone, then the same with a combining accent after it."""
    blob = _proto(models[f"unigram-{rule}"]).normalizer_spec.precompiled_charsmap
    hf, ours = N.Precompiled(blob), _precompiled(blob)
    chars = [chr(cp) for cp in [*range(1, 0xD800), *range(0xE000, 0x10000), *range(0x10000, 0x110000, 31)]]
    assert [ours.normalize(c) for c in chars] == [hf.normalize_str(c) for c in chars]
    marked = [c + "\u0301" for c in chars[::3]]
    assert [ours.normalize(c) for c in marked] == [hf.normalize_str(c) for c in marked]


def test_precompiled_is_parsed_once(models):
    """The charsmap (a T5-sized one is ~240 KB) is parsed once per process, not once per tokenizer."""
    d = json.loads(C.T5Converter(_original(models["t5"])).converted().to_str())
    a, b = tokenizer_from_json(d), tokenizer_from_json(json.loads(json.dumps(d)))
    encoded = d["normalizer"]["normalizers"][0]["precompiled_charsmap"]
    assert a.normalizer.normalizers[0]._charsmap is b.normalizer.normalizers[0]._charsmap is charsmap(encoded)


@pytest.mark.parametrize("value,why", [
    ("", "shorter than its 4-byte header"), ("not base64!", "not valid base64"), (None, "base64 string"),
    (base64.b64encode(b"\x40\x00\x00\x00" + b"\x00" * 8).decode(), "announces a 64-byte trie"),
    (base64.b64encode(b"\x04\x00\x00\x00\x00\x04\x00\x00\xff\xfe").decode(), "not UTF-8"),
])
def test_bad_charsmap_is_one_clear_error(bpe_json, value, why):
    d = dict(bpe_json, normalizer={"type": "Precompiled", "precompiled_charsmap": value})
    with pytest.raises(TokenizerError, match=f"Precompiled.*{why}"):
        tokenizer_from_json(d)


@pytest.fixture
def bpe_json():
    return {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
