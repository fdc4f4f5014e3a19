"""lmkit's BPE and WordPiece trainers against `tokenizers`' BpeTrainer / WordPieceTrainer, the way a user builds
the same tokenizer there (a fresh `Tokenizer`, its normalizer and pre-tokenizer, `train_from_iterator`).

What `tokenizers` itself decides at random is left out of the exact comparisons: it numbers ##-continuation
(and end-of-word) tokens in hash-map order and breaks count ties by id, and it breaks limit_alphabet frequency
ties in hash order, so those runs differ from one `tokenizers` run to the next.
"""
import json
import random
from collections import Counter

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from lmkit.errors import TokenizerError  # noqa: E402
from lmkit.tokenizers import train_tokenizer  # noqa: E402
from lmkit.tokenizers.trainers.bpe import train_bpe  # noqa: E402

SPECIALS_IN_TEXT = ["<|endoftext|>hello world<|endoftext|> hello <|pad|>", "world <|endoftext|>", "a b a b abab",
                    "[CLS] hello [SEP] [MASK] world [SEP]"] * 3


def _hf_byte_level(texts, size, specials, **kw):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), **kw))
    return tok


def _assert_same_bpe(ours, hf, held_out):
    theirs = json.loads(hf.to_str())["model"]
    assert ours.model.vocab == theirs["vocab"]
    assert [list(m) for m in ours.model.merges] == [list(m) for m in theirs["merges"]]
    for text in held_out:
        assert ours.encode(text) == hf.encode(text).ids, text


@pytest.mark.parametrize("specials", [["<|endoftext|>", "<|pad|>"], ["<|pad|>", "a", "<|endoftext|>"], ["ab"]])
def test_special_tokens_written_in_the_text_train_as_text(specials):
    # `tokenizers` feeds the trainer the pre-tokenized text as it is: "<|endoftext|>" in the text gives "<|", "|>"
    # merges, a special "a" still leaves the letter a in the words. (lmkit used to cut special tokens out first.)
    size = 256 + len(specials) + 30
    ours = train_tokenizer(SPECIALS_IN_TEXT, "bpe", size, special_tokens=specials)
    hf = _hf_byte_level(SPECIALS_IN_TEXT, size, specials)
    _assert_same_bpe(ours, hf, ["<|endoftext|>hello a<|pad|>b", "ab ab abab [SEP]"])
    assert ["<", "|"] in [list(m) for m in ours.model.merges]


def test_wordpiece_special_tokens_written_in_the_text_train_as_text():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(SPECIALS_IN_TEXT, trainers.WordPieceTrainer(
        vocab_size=5000, special_tokens=specials, limit_alphabet=1000, show_progress=False))
    theirs = json.loads(tok.to_str())["model"]["vocab"]
    ours = train_tokenizer(SPECIALS_IN_TEXT, "wordpiece", 5000, special_tokens=specials).model.vocab
    # the ids of ## tokens are hash-ordered in `tokenizers` (and so are its count ties): compare what is fixed
    fixed = lambda v: {t: i for t, i in v.items() if t in specials or len(t) == 1}  # noqa: E731
    assert fixed(ours) == fixed(theirs) and "[" in ours and "k" in ours
    continuations = lambda v: {t for t in v if t.startswith("##") and len(t) == 3}  # noqa: E731
    assert continuations(ours) == continuations(theirs) and "##k" in ours


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "char", "word"])
@pytest.mark.parametrize("size", [0, -5, 2.5, True, "300"])
def test_vocab_size_must_be_a_positive_integer(kind, size):
    with pytest.raises(TokenizerError, match="vocab_size must be a positive integer"):
        train_tokenizer(["hello world"], kind, size)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "char", "word"])
def test_vocab_too_small_for_special_tokens_and_alphabet_is_one_clear_error(kind):
    texts = ["hello wörld 北京"]
    with pytest.raises(TokenizerError, match=r"use vocab_size >= \d+"):
        train_tokenizer(texts, kind, 3)
    if kind == "wordpiece":  # 5 specials + 9 letters (accents stripped) + 5 ##-forms; `tokenizers` would return all 19
        with pytest.raises(TokenizerError, match="vocab_size >= 19"):
            train_tokenizer(texts, kind, 18)
        assert train_tokenizer(texts, kind, 19).vocab_size == 19
    if kind == "bpe":
        with pytest.raises(TokenizerError, match="vocab_size >= 258"):
            train_tokenizer(texts, kind, 257)
        assert len(train_tokenizer(texts, kind, 256, special_tokens=["a"]).model.merges) == 0  # "a" is a byte


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "char", "word"])
@pytest.mark.parametrize("texts", [[], [""], iter([])])
def test_empty_corpus_is_one_clear_error(kind, texts):
    with pytest.raises(TokenizerError, match="no text to train on"):
        train_tokenizer(texts, kind, 300)


def _hf_words(texts, size, **kw):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, show_progress=False, **kw))
    m = json.loads(tok.to_str())["model"]
    return m["vocab"], [tuple(x) for x in m["merges"]]


def _random_case(rng):
    chars = rng.sample("abcdeé北京😀\u0301", rng.randint(2, 6))
    words = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 14))) for _ in range(rng.randint(2, 40))]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(rng.randint(1, 5))]
    counts = Counter(w for t in texts for w in t.split())
    freq = Counter()
    for w, c in counts.items():
        for ch in w:
            freq[ch] += c
    kw = {}
    if rng.random() < 0.4:
        kw["min_frequency"] = rng.randint(1, 4)
    if rng.random() < 0.4:
        kw["special_tokens"] = list(dict.fromkeys(["<s>"] + rng.sample(words, 2)))  # may equal a merge result
    if rng.random() < 0.4:
        kw["initial_alphabet"] = rng.sample("abxyzQ北", rng.randint(1, 3))
    if rng.random() < 0.4 and len(set(freq.values())) == len(freq):  # frequency ties: hash order in `tokenizers`
        kw["limit_alphabet"] = rng.randint(len(kw.get("initial_alphabet", ())), len(freq) + 1)
    return texts, counts, rng.randint(1, 400), kw


def test_bpe_trainer_matches_tokenizers_on_random_corpora_and_options():
    # overlapping runs (aaaa), equal counts, tiny and huge vocabularies, every BpeTrainer option the lmkit
    # trainer takes that `tokenizers` runs deterministically
    rng = random.Random(7)
    for case in range(60):
        texts, counts, size, kw = _random_case(rng)
        theirs = _hf_words(texts, size, **kw)
        kw = dict(kw)
        vocab, merges = train_bpe(dict(counts), size, kw.pop("special_tokens", []), **kw)
        assert (vocab, merges) == theirs, (case, texts, size, kw)


@pytest.mark.parametrize("max_token_length", [0, 1, 2, 3, 5])
def test_bpe_trainer_max_token_length_matches_tokenizers(max_token_length):
    # `tokenizers` keeps a new pair only while it spans < max_token_length characters; the first pairs of two
    # characters stay candidates whatever the limit
    rng = random.Random(max_token_length)
    for case in range(12):
        texts, counts, size, kw = _random_case(rng)
        kw["max_token_length"] = max_token_length
        theirs = _hf_words(texts, size, **kw)
        kw = dict(kw)
        vocab, merges = train_bpe(dict(counts), size, kw.pop("special_tokens", []), **kw)
        assert (vocab, merges) == theirs, (case, texts, size, kw)
        learned = [a + b for a, b in merges]
        assert all(len(t) <= max(2, max_token_length - 1) for t in learned)
