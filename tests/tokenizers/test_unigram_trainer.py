"""lmkit's Unigram trainer against `tokenizers`' UnigramTrainer: the same pieces, scores and ids.

Both trainers see the same words (pre-tokenized by `tokenizers` itself, so only the trainers are compared).
Two things may legitimately differ, and the assertions allow exactly those: `tokenizers` sums over its words
in hash order (scores agree to ~1e-12, not bit for bit), and it scores the characters EM dropped at
min score + 1e-4 k in hash order (lmkit goes in code point order), so those differ by at most 1e-4 per such
character, and equal-score pieces may swap ids.
"""
import json
import random
from collections import Counter

import numpy as np
import pydoc_data.topics
import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import models, normalizers, pre_tokenizers, trainers  # noqa: E402

from lmkit.errors import TokenizerError  # noqa: E402
from lmkit.tokenizers import train_tokenizer  # noqa: E402
from lmkit.tokenizers.trainers.suffix import repeats  # noqa: E402
from lmkit.tokenizers.trainers.unigram import _Corpus, _seeds, train_unigram  # noqa: E402

DOCS = "\n".join(v for _, v in sorted(pydoc_data.topics.topics.items()))
PY = [DOCS[i:i + 400] for i in range(0, 30_000, 400)]


def _unicode_texts(n=2500, seed=1):
    rng = random.Random(seed)
    scripts = ["abcdéèüöçñ", "αβγδεζηθ", "абвгдежз", "的一是不了人我在", "가나다라마바", "😀🤖🎉", "ابتثجح"]
    lexicon = ["".join(rng.choice(rng.choice(scripts)) for _ in range(rng.randint(1, 6))) for _ in range(300)]
    words = rng.choices(lexicon, [1 / (r + 1) for r in range(300)], k=n)
    return [" ".join(words[i:i + 10]) for i in range(0, n, 10)]


def _hf(texts, **kw):
    tok = tokenizers.Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(texts, trainers.UnigramTrainer(show_progress=False, **kw))
    m = json.loads(tok.to_str())["model"]
    return [(p, s) for p, s in m["vocab"]], m["unk_id"]


def _words(texts):
    norm, pre = normalizers.NFKC(), pre_tokenizers.Metaspace()
    return Counter(w for t in texts for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)))


def _assert_same(ours, theirs, n_chars):
    (mine, my_unk), (hf, hf_unk) = ours, theirs
    assert my_unk == hf_unk
    assert {p for p, _ in mine} == {p for p, _ in hf}
    assert len(mine) == len(hf)
    hf_score = dict(hf)
    for p, s in mine:
        tol = 1e-4 * n_chars + 1e-12 if len(p) == 1 else 1e-9 * max(1.0, abs(s))
        assert abs(s - hf_score[p]) <= tol, (p, s, hf_score[p])
    scores = [s for _, s in hf]
    for i, ((a, sa), (b, _)) in enumerate(zip(mine, hf)):  # ids: the same wherever HF's score is not tied
        near = [s for j, s in enumerate(scores) if j != i and abs(s - scores[i]) <= 1e-4 * n_chars + 1e-9]
        if not near:
            assert a == b, (i, a, b)


SETTINGS = [
    ("py", 200, dict(special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")),
    ("py", 800, dict(special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")),
    ("py", 300, dict(special_tokens=["[SEP]", "[CLS]"], unk_token="[UNK]")),  # unk goes first, at id 0
    ("py", 300, dict()),  # no special token, no unk
    ("py", 400, dict(unk_token="<unk>", max_piece_length=4, shrinking_factor=0.5)),
    ("py", 400, dict(unk_token="<unk>", n_sub_iterations=1, shrinking_factor=0.9)),
    ("py", 300, dict(unk_token="<unk>", initial_alphabet=["x", "Ω", "€uro", "ж"])),  # only the first character
    ("uni", 400, dict(special_tokens=["<pad>", "<unk>"], unk_token="<unk>")),
    ("uni", 1200, dict(unk_token="<unk>", max_piece_length=3)),
]


@pytest.mark.parametrize("corpus,vocab_size,kw", SETTINGS)
def test_unigram_trainer_learns_the_pieces_of_tokenizers(corpus, vocab_size, kw):
    texts = PY if corpus == "py" else _unicode_texts()
    counts = _words(texts)
    alphabet = {ch for w in counts for ch in w} | {a[0] for a in kw.get("initial_alphabet", ())}
    ours = train_unigram(counts, vocab_size, **kw)
    _assert_same(ours, _hf(texts, vocab_size=vocab_size, **kw), len(alphabet))


def test_train_tokenizer_unigram_is_tokenizers_unigram():
    """The public entry: default specials, NFKC + Metaspace done by lmkit itself, the same vocabulary."""
    specials = ["<pad>", "</s>", "<unk>"]
    tok = train_tokenizer(PY, "unigram", 500, special_tokens=specials)
    counts = _words(PY)
    _assert_same((tok.model.pieces, tok.model.unk_id), _hf(PY, vocab_size=500, special_tokens=specials,
                                                             unk_token="<unk>"), len({c for w in counts for c in w}))
    # an unk token missing from special_tokens goes to id 0, as tokenizers puts it
    tok = train_tokenizer(PY[:20], "unigram", 300, special_tokens=["<pad>"])
    assert [p for p, _ in tok.model.pieces[:2]] == ["<unk>", "<pad>"] and tok.model.unk_id == 0


def test_unigram_seeds_are_the_suffix_array_ones():
    """tokenizers' own unit test: characters by count, then right-maximal repeats by occurrences * length."""
    pieces, raw, *_ = _seeds(_Corpus(["This is a", "こんにちは友達"], [1, 1]), 16, 1_000_000)
    assert pieces == ["s", "i", " ", "達", "友", "ん", "は", "に", "ち", "こ", "h", "a", "T", "is ", "s "]
    logp = np.log(raw) - np.log(raw.sum())
    assert np.allclose(logp[[0, 3, 13, 14]], [-2.5649493574615367, -3.258096538021482, -1.4663370687934272,
                                              -1.8718021769015916], atol=1e-12)
    # seed_size counts the characters; a word's count weighs its characters, not its substrings
    pieces, raw, *_ = _seeds(_Corpus(["abab", "abc"], [10, 1]), 16, 4)
    assert pieces == ["b", "a", "c", "ab"] and list(raw) == [21.0, 21.0, 1.0, 6.0]


def test_suffix_tree_nodes_are_the_right_maximal_repeats():
    rng = random.Random(0)
    for trial in range(200):
        t = "".join(rng.choice("ab\0c" if trial % 2 else "aab") for _ in range(rng.randint(0, 50)))
        max_len = rng.randint(1, 7)
        occ: dict[str, list[int]] = {}
        for i in range(len(t)):
            for d in range(2, max_len + 1):
                if i + d <= len(t):
                    occ.setdefault(t[i:i + d], []).append(i)
        brute = {s: len(p) for s, p in occ.items()
                 if len(p) > 1 and len({t[i + len(s)] if i + len(s) < len(t) else None for i in p}) > 1}
        sa, nodes = repeats(np.array([ord(c) for c in t], dtype=np.int64), max_len)
        got = {t[sa[a]:sa[a] + d]: int(b - a) for d, lo, hi in nodes for a, b in zip(lo, hi)}
        assert got == brute, (t, max_len)
        for d, lo, hi in nodes:
            for a, b in zip(lo, hi):
                s = t[sa[a]:sa[a] + d]
                assert sorted(sa[a:b]) == [i for i in range(len(t)) if t.startswith(s, i)]


def test_unigram_trainer_settings_are_checked():
    counts = Counter({"▁ab": 3, "▁ba": 2})
    for kw in (dict(shrinking_factor=1.0), dict(shrinking_factor=0.0), dict(max_piece_length=0),
               dict(n_sub_iterations=0)):
        with pytest.raises(TokenizerError):
            train_unigram(counts, 50, **kw)
    with pytest.raises(TokenizerError, match="use vocab_size >= 4"):
        train_unigram(counts, 3, ["<unk>"], "<unk>")
    pieces, unk = train_unigram(counts, 4, ["<unk>"], "<unk>")
    assert unk == 0 and pieces[0] == ("<unk>", 0.0) and {"a", "b", "▁"} <= {p for p, _ in pieces} and len(pieces) == 4
