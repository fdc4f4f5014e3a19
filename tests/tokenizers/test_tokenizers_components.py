"""Each tokenizer.json component read from the JSON that Hugging Face `tokenizers` writes for it, and run
side by side with it: normalizers, pre-tokenizers, decoders, post-processors, added-token flags."""
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex  # noqa: E402
from tokenizers import decoders as D  # noqa: E402
from tokenizers import normalizers as N  # noqa: E402
from tokenizers import pre_tokenizers as P  # noqa: E402
from tokenizers import processors as R  # noqa: E402

from lmkit.tokenizers import tokenizer_from_json  # noqa: E402
from lmkit.tokenizers.decoders import decoder_from_json  # noqa: E402
from lmkit.tokenizers.normalizers import normalizer_from_json  # noqa: E402
from lmkit.tokenizers.pre_tokenizers import GPT4_PATTERN, pre_tokenizer_from_json  # noqa: E402

SAMPLES = [
    "Hello, World! It's 2024; naïve café ÅNGSTRÖM ﬁ ①",
    "  leading   and trailing  \t\n", "北京欢迎你 東京 한국어 ḱṷṓn", "don't__stop-me now 3.14 +=== ...",
    "a\u00a0b\u2003c\u3000d\u200be\r\nf", "x\u0301y\u0308z Ａｂｃ", "😀👍🏽 👩‍👩‍👧 🇫🇷", "", " ", "▁already▁metaspace",
    "def f(x):\n    return x ** 2  # square\n\n\n", "1234567 12 1 a1b22c333 ½²٣Ⅻ", "ΟΔΥΣΣΕΥΣ ΣΑΣ. aΣ İ",
    "नमस्ते दुनिया ক্ষ বাংলা \u0488x",
]


def state(component) -> dict:
    return json.loads(component.__getstate__())


@pytest.mark.parametrize("hf", [
    N.NFC(), N.NFD(), N.NFKC(), N.NFKD(), N.Lowercase(), N.Sequence([N.NFD(), N.StripAccents()]),
    N.BertNormalizer(), N.BertNormalizer(lowercase=False), N.BertNormalizer(strip_accents=True, lowercase=False),
    N.BertNormalizer(clean_text=False, handle_chinese_chars=False), N.Sequence([N.NFKC(), N.Lowercase()]),
    N.Strip(), N.Replace("a", "b"), N.Prepend("▁"), N.Replace(Regex(r"\s+"), " "), N.Replace(Regex(r"^ +| +$"), ""),
    N.Replace(Regex(r"e*"), "-"), N.Replace("", "|"), N.Nmt(), N.ByteLevel(),
], ids=lambda h: json.dumps(state(h))[:60])
def test_normalizers(hf):
    ours = normalizer_from_json(state(hf))
    for s in SAMPLES:
        assert ours.normalize(s) == hf.normalize_str(s), s


@pytest.mark.parametrize("hf", [
    P.ByteLevel(add_prefix_space=False), P.ByteLevel(add_prefix_space=True), P.ByteLevel(use_regex=False),
    P.Whitespace(), P.WhitespaceSplit(), P.BertPreTokenizer(), P.Punctuation(),
    P.Metaspace(), P.Metaspace(prepend_scheme="first"), P.Metaspace(prepend_scheme="never"),
    P.Metaspace(split=False), P.Metaspace(replacement="_"),
    *[P.Split(Regex(r"\d+"), b, invert=inv) for b in ("removed", "isolated", "merged_with_previous",
                                                      "merged_with_next", "contiguous") for inv in (False, True)],
    P.Split(" ", "removed"), P.Split(Regex(GPT4_PATTERN), "isolated"),
    P.Split(Regex(r"^ +|:$"), "isolated"),
    P.Digits(individual_digits=True), P.Digits(), P.CharDelimiterSplit("e"), P.FixedLength(3), P.UnicodeScripts(),
    P.Sequence([P.UnicodeScripts(), P.Metaspace(prepend_scheme="first")]),
    P.Sequence([P.Digits(individual_digits=True), P.Whitespace()]),
    P.Sequence([P.WhitespaceSplit(), P.Punctuation()]),
    P.Sequence([P.Split(Regex(GPT4_PATTERN), "isolated"), P.ByteLevel(add_prefix_space=False, use_regex=False)]),
], ids=lambda h: json.dumps(state(h))[:70])
def test_pre_tokenizers(hf):
    ours = pre_tokenizer_from_json(state(hf))
    for s in SAMPLES:
        assert ours.split(s) == [w for w, _ in hf.pre_tokenize_str(s)], s


TOKENS = [["▁Hello", "▁wor", "ld", "!", "▁", "▁x"], ["<pad>", "h", "h", "<pad>", "h", "|", "|", "e", "'s", "▁", "!"], ["Hello", "##wor", "##ld", "!", ",", "do", "n't", "'s", "."],
          ["Ġhello", "Ġw", "orld", "Ċ", "ðŁĺ", "Ģ", "<|endoftext|>", "ĠâĢ"], ["un</w>", "believ", "able</w>"], [],
          ["▁Hi", "<0xE2>", "<0x82>", "<0xAC>", "▁x", "<0xFF>", "<0x41>", "<0xZZ>", "  pad  ", "<0xF0>"]]


@pytest.mark.parametrize("hf", [D.ByteLevel(), D.WordPiece(), D.WordPiece(cleanup=False), D.Metaspace(),
                                D.Metaspace(prepend_scheme="never"), D.BPEDecoder(), D.Fuse(),
                                D.Sequence([D.Metaspace(), D.Fuse()]), D.ByteFallback(), D.Strip(" ", 1, 2),
                                D.Sequence([D.Replace("▁", " "), D.ByteFallback(), D.Fuse(), D.Strip(" ", 1, 0)]),
                                D.Replace(Regex("▁+|#{2,}"), " "), D.CTC(), D.CTC("▁", "Ġ", cleanup=False),
                                D.CTC("##", "!", cleanup=True), D.Sequence([D.CTC("<0xFF>", "▁"), D.ByteFallback()])],
                         ids=lambda h: state(h)["type"])
def test_decoders(hf):
    ours = decoder_from_json(state(hf))
    for toks in TOKENS:
        assert ours.decode(toks) == hf.decode(toks), toks


VOCAB = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "<s>", "</s>", "<pad>", "hello", "world", "a", "b",
                                     "c", "!", ",", "<x>", "[MASK]"])}


def _wordlevel():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = P.Whitespace()
    return tok


@pytest.mark.parametrize("proc", [
    R.BertProcessing(("[SEP]", 2), ("[CLS]", 1)), R.RobertaProcessing(("</s>", 4), ("<s>", 3)),
    R.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B:1 </s>:1",
                         special_tokens=[("<s>", 3), ("</s>", 4)]),
    R.TemplateProcessing(single="$A:0 </s>:0", pair="$A:0 $B:1 </s>:1", special_tokens=[("</s>", 4)]),
    R.Sequence([R.ByteLevel(), R.TemplateProcessing(single="<s> $A", pair="<s> $A <s>:1 $B:1",
                                                    special_tokens=[("<s>", 3)])]),
    R.TemplateProcessing(single="$A:1 </s>:2", pair="$B:1 </s>:0 $A:0 <s>:3", special_tokens=[("<s>", 3), ("</s>", 4)]),
    R.Sequence([R.ByteLevel(), R.RobertaProcessing(("</s>", 4), ("<s>", 3))]),
], ids=lambda p: json.dumps(state(p))[:70])
@pytest.mark.parametrize("add", [True, False])
def test_post_processors_pairs_and_truncation(proc, add):
    """Without special tokens the processor still runs in `tokenizers`: a template orders A and B and gives
    their type ids, RoBERTa's makes every type id 0."""
    hf = _wordlevel()
    hf.post_processor = proc
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    a, b = "hello world ! a b c hello", "c b a , world"
    for args in [(a,), (a, b), (b, a)]:
        pair = args[1] if len(args) > 1 else None
        enc = hf.encode(*args, add_special_tokens=add)
        assert ours.encode(args[0], pair=pair, add_special_tokens=add) == enc.ids
        mine = ours.encode_plus(args[0], pair=pair, add_special_tokens=add)
        assert (mine.ids, mine.type_ids, mine.special_tokens_mask) == (enc.ids, enc.type_ids, enc.special_tokens_mask)
        batch = ours([args[0]] * 2, pair=[pair] * 2 if pair else None, add_special_tokens=add)
        assert batch["token_type_ids"] == [enc.type_ids] * 2
        for n in (6, 9, 10):
            hf.enable_truncation(n)
            enc = hf.encode(*args, add_special_tokens=add)
            mine = ours.encode_plus(args[0], pair=pair, truncation=True, max_length=n, add_special_tokens=add)
            assert (mine.ids, mine.type_ids) == (enc.ids, enc.type_ids), n
            hf.no_truncation()


@pytest.mark.parametrize("flags", [{}, {"lstrip": True}, {"rstrip": True}, {"lstrip": True, "rstrip": True},
                                   {"single_word": True}, {"normalized": True}, {"special": False}])
def test_added_token_flags(flags):
    hf = _wordlevel()
    hf.normalizer = N.Lowercase()
    hf.add_special_tokens([tokenizers.AddedToken("[MASK]", **flags)])
    hf.add_tokens([tokenizers.AddedToken("<X>", **{**flags, "normalized": flags.get("normalized", True)})])
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    for s in ["hello [MASK] world", "hello[MASK]world", "a  [MASK]  b", "[MASK][MASK]", "x<X>y <x> <X> Hello",
              "HELLO [mask] World", "[MASK]", ""]:
        assert ours.encode(s) == hf.encode(s).ids, s
        assert ours.tokenize(s) == hf.encode(s, add_special_tokens=False).tokens, s  # an added token: the text it matched
        ids = hf.encode(s).ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_llama_style_bpe_with_byte_fallback():
    """SentencePiece-BPE as Llama 2 stores it: Prepend + Replace normalizer, no pre-tokenizer, byte fallback."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    hf.normalizer = N.Sequence([N.Prepend("▁"), N.Replace(" ", "▁")])
    hf.decoder = D.Sequence([D.Replace("▁", " "), D.ByteFallback(), D.Fuse(), D.Strip(" ", 1, 0)])
    lines = [s.strip() for s in SAMPLES[:4] + SAMPLES[10:] for s in s.splitlines() if s.strip()] * 3
    hf.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"],
                                                                  show_progress=False))
    d = json.loads(hf.to_str())
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    hf = tokenizers.Tokenizer.from_str(json.dumps(d))
    ours = tokenizer_from_json(d)
    for s in SAMPLES + ["Ünïcödé ☃ 😀", "<s>hello<s>"]:
        ids = hf.encode(s).ids
        assert ours.encode(s) == ids, s
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), s


@pytest.mark.parametrize("fuse", [True, False])
def test_bpe_unk_is_written_after_byte_fallback_tokens(fuse):
    """With part of the byte tokens missing, HF holds an unknown character's unk back until the next known
    character: byte tokens in between come first, and fuse_unk joins the unknowns around them."""
    vocab = {"<unk>": 0, "a": 1, "<0x62>": 2, "<0x63>": 3}
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", fuse_unk=fuse, byte_fallback=True))
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    for s in ["éba", "ééb", "aébéc", "é", "bé", "éaé"]:
        assert ours.tokenize(s) == hf.encode(s).tokens, s
        assert ours.encode(s) == hf.encode(s).ids, s


@pytest.mark.parametrize("scheme", ["first", "always", "never"])
def test_metaspace_prepend_scheme_around_special_tokens(scheme):
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "▁hello", "hello", "▁world", "world", "▁", "x", "▁x"])}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = P.Metaspace(prepend_scheme=scheme)
    hf.add_special_tokens(["<s>"])
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    for s in ["<s>hello world", "hello<s>world", "hello <s> world", "<s> x", " hello", ""]:
        assert ours.encode(s) == hf.encode(s).ids, s


def test_added_tokens_found_on_the_text_alone_and_skipped_by_string():
    """HF finds added tokens before stripping: an rstrip that swallows the space a later match starts with does
    not hide it. Ids are HF's (model id of the content, else the next free one), empty contents are ignored, and
    skip_special_tokens drops every id whose string is a special token's content."""
    hf = _wordlevel()
    hf.add_tokens([tokenizers.AddedToken(" x", rstrip=True, normalized=False),
                   tokenizers.AddedToken(" y", lstrip=True, rstrip=True, normalized=False)])
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    for s in [" x x", "a x x  x", " y y", "a  y y  y b"]:
        assert ours.encode(s) == hf.encode(s).ids, s
    d = json.loads(_wordlevel().to_str())
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    d["added_tokens"] = [{"id": 40, "content": "<z>", "special": True, **flags},
                         {"id": 3, "content": "", "special": True, **flags},
                         {"id": 0, "content": "hello", "special": True, **flags}]
    hf, ours = tokenizers.Tokenizer.from_str(json.dumps(d)), tokenizer_from_json(d)
    for s in ["hello <z> world", "<z>hello<z>", ""]:
        assert ours.encode(s) == hf.encode(s).ids, s
    ids = [15, 6, 7, 0]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


FIRST_INPUTS = ["  hello", "hello", "\x01hello", "\u0301hello", "\x00hi", "\u200bhi", "xhi", "x", " ", "\ufffdhi",
                "Ａ\u0301hi", "\x01\x02hi", "e\u0301hi", " \x01hi", "\x01 hi", "\u0301", "\x01", "<s>  hi", " <s>hi",
                "\u0344hi"]


@pytest.mark.parametrize("pre", [P.Metaspace(prepend_scheme="first", split=False), P.Metaspace(prepend_scheme="first"),
                                 P.Sequence([P.WhitespaceSplit(), P.Metaspace(prepend_scheme="first")]),
                                 P.Sequence([P.Punctuation(), P.Metaspace(prepend_scheme="first")])],
                         ids=lambda p: json.dumps(state(p))[:80])
@pytest.mark.parametrize("norm", [None, N.Strip(), N.Strip(left=False), N.Replace(" ", ""), N.Replace(Regex(r"\A +"), ""),
                                  N.Replace(Regex(" {2,}"), "▁"), N.Replace("x", ""), N.Nmt(), N.StripAccents(),
                                  N.Sequence([N.NFD(), N.StripAccents()]), N.BertNormalizer(), N.Prepend("q"),
                                  N.Sequence([N.Replace(Regex(r"\A +| +\z"), ""), N.Replace(" ", "▁")])],
                         ids=lambda n: json.dumps(state(n))[:60] if n else "none")
def test_metaspace_first_reads_the_original_start(norm, pre):
    """prepend_scheme "first" prepends only to a piece that begins at the input's start in HF's alignments: a
    normalizer or an earlier pre-tokenizer that removes the leading characters moves the start (Precompiled,
    which gives the next character the removed one's alignment, does not). Unknown text shows in a Unigram's
    tokens, so the tokens show every ▁ added."""
    hf = tokenizers.Tokenizer(tokenizers.models.Unigram([("<unk>", 0.0), ("▁", -1.0), ("<s>", 0.0)], unk_id=0))
    if norm is not None:
        hf.normalizer = norm
    hf.pre_tokenizer = pre
    hf.add_special_tokens(["<s>"])
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    for s in FIRST_INPUTS:
        assert ours.tokenize(s) == hf.encode(s).tokens, s


def test_unicode_scripts_on_every_character():
    """Each BMP character and every 17th astral one between a Latin letter, a digit (Common) and a space (Any):
    HF's script table is SentencePiece's of Unicode 9, with Hiragana/Katakana as Han and text before the first
    character with a script dropped."""
    hf, ours = P.UnicodeScripts(), pre_tokenizer_from_json({"type": "UnicodeScripts"})
    chars = [chr(cp) for cp in [*range(0xD800), *range(0xE000, 0x10000), *range(0x10000, 0x110000, 17)]]
    for c in chars:
        text = f"{c}a{c}1 {c}"
        assert ours.split(text) == [w for w, _ in hf.pre_tokenize_str(text)], hex(ord(c))


def test_adding_a_token_again_replaces_its_flags():
    """HF's add_special_tokens on a content already added makes it a plain special token with the same id."""
    hf = _wordlevel()
    hf.normalizer = N.Lowercase()
    hf.add_tokens([tokenizers.AddedToken("<X>", single_word=True, normalized=True, special=False)])
    hf.add_special_tokens([tokenizers.AddedToken("[MASK]", lstrip=True, rstrip=True)])
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    new = ["<X>", "[MASK]", "hello", "<new>"]
    hf.add_special_tokens(new)
    assert ours.add_special_tokens(new) == [hf.token_to_id(t) for t in new]
    assert ours.to_json()["added_tokens"] == json.loads(hf.to_str())["added_tokens"]
    reloaded = tokenizers.Tokenizer.from_str(hf.to_str())  # hf itself still decodes <X> as it was normalized
    for s in ["a<X>b  [MASK]  hello", "<x> <X>[MASK]<new>"]:
        ids = hf.encode(s).ids
        assert ours.encode(s) == ids == reloaded.encode(s).ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reloaded.decode(ids, skip_special_tokens=skip)
