"""lmkit.tokenizers on its own: each algorithm's defining property, special tokens, pairs, padding, files."""
import itertools
import json
import math
from collections import Counter

import pytest
import pydoc_data.topics

from lmkit.errors import LmkitError, TokenizerError
from lmkit.tokenizers import load_tokenizer, tokenizer_from_json, train_tokenizer
from lmkit.tokenizers.models import BPE, Unigram, WordPiece
from lmkit.tokenizers.pre_tokenizers import byte_level
from lmkit.tokenizers.trainers.bpe import train_bpe

TEXTS = [v for _, v in sorted(pydoc_data.topics.topics.items())][:40]


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer(TEXTS, "bpe", 600)


@pytest.fixture(scope="module")
def wordpiece():
    return train_tokenizer(TEXTS, "wordpiece", 700)


@pytest.fixture(scope="module")
def unigram():
    return train_tokenizer(TEXTS[:8], "unigram", 400)


def naive_bpe(word_counts, n_merges, alphabet):
    """Reference trainer: recount every pair after each merge (quadratic, obviously correct)."""
    ids = {c: i for i, c in enumerate(alphabet)}
    names = list(alphabet)
    words = {tuple(ids[c] for c in w): n for w, n in word_counts.items()}
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, n in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        new = len(names)
        names.append(names[best[0]] + names[best[1]])
        merges.append((names[best[0]], names[best[1]]))
        out = {}
        for w, n in words.items():
            r, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == best:
                    r.append(new)
                    i += 2
                else:
                    r.append(w[i])
                    i += 1
            out[tuple(r)] = out.get(tuple(r), 0) + n
        words = out
    return merges


def test_incremental_bpe_trainer_equals_recount_per_merge():
    counts = Counter(byte_level(w) for t in TEXTS[:10] for w in t.split())
    alphabet = sorted({c for w in counts for c in w})
    _, merges = train_bpe(dict(counts), len(alphabet) + 150)
    assert merges == naive_bpe(counts, 150, alphabet)


def test_bpe_applies_merges_by_rank():
    vocab = {c: i for i, c in enumerate("abc")} | {"bc": 3, "ab": 4, "abc": 5}
    model = BPE(vocab, [("b", "c"), ("a", "b"), ("a", "bc")])
    assert model.tokenize("abc") == ["abc"]  # (b,c) has the lower rank, so "a"+"bc"
    assert BPE(vocab, [("a", "b"), ("b", "c"), ("a", "bc")]).tokenize("abc") == ["ab", "c"]
    assert model.tokenize("abab") == ["ab", "ab"]


def test_bpe_lossless_and_bytes(bpe):
    s = "héllo\u200b wörld 🤖\r\n\ttabs\x00 and 中文"
    assert bpe.decode(bpe.encode(s)) == s
    assert all(0 <= i < bpe.vocab_size for i in bpe.encode(s))


def test_tiktoken_engine_matches_python_path(bpe, monkeypatch):
    assert bpe.engine() is not None
    texts = TEXTS[-5:] + ["<|endoftext|>mixed<|pad|> special", "  spaces   and\n\nnewlines  "]
    fast = [bpe.encode(t) for t in texts]
    slow = [bpe._encode_plain(t, python_only=True) for t in texts]
    assert fast == slow


def test_tiktoken_engine_batches_keep_order_and_ids_over_many_short_texts(bpe):
    """encode_batch through the engine hands the threads chunks of texts: every row in order, with the ids of
    one-by-one encoding, whatever the thread count and however the texts split into chunks."""
    from lmkit.tokenizers.fast import encode_many

    engine = bpe.engine()
    assert engine is not None
    base = TEXTS + ["", " ", "<|endoftext|>", "中文 🤖", "x" * 300, "a\n\nb"]
    texts = [f"{t} {i}" if i % 3 else t for i, t in enumerate(base * 7)]  # 7 x len(base) rows, some repeated
    want = [bpe._encode_plain(t, python_only=True) for t in texts]
    for threads in (1, 2, 3, 5):
        assert engine.encode_batch(texts, threads) == want
        assert engine.encode_batch(texts[:threads + 1], threads) == want[:threads + 1]  # fewer rows than chunks
    assert encode_many(bpe, texts, num_workers=2) == want
    assert bpe.encode_batch(texts, add_special_tokens=False) == [bpe.encode(t, add_special_tokens=False) for t in texts]


def test_special_tokens_never_split(bpe, wordpiece):
    eot = bpe.token_to_id("<|endoftext|>")
    ids = bpe.encode("end<|endoftext|>start")
    assert ids.count(eot) == 1 and bpe.decode(ids) == "end<|endoftext|>start"
    assert bpe.decode(ids, skip_special_tokens=True) == "endstart"
    ids = wordpiece.encode("paris is the [MASK] of france", add_special_tokens=False)
    assert wordpiece.mask_token_id in ids


def test_wordpiece_greedy_longest_match_and_unk():
    vocab = {t: i for i, t in enumerate(["[UNK]", "un", "unaff", "##aff", "##able", "##a", "##ff", "##ab", "##le"])}
    wp = WordPiece(vocab, max_input_chars_per_word=8)
    assert wp.tokenize("unaffable") == ["[UNK]"]  # 9 characters > 8
    wp = WordPiece(vocab)
    assert wp.tokenize("unaffable") == ["unaff", "##able"]
    assert wp.tokenize("unx") == ["[UNK]"]  # no cover of the whole word: the word is unknown


def test_unigram_viterbi_is_the_best_segmentation():
    pieces = [("<unk>", 0.0), ("a", -2.0), ("b", -2.5), ("ab", -3.0), ("abc", -7.0), ("c", -3.2), ("bc", -4.0)]
    model = Unigram(pieces, unk_id=0)
    for word in ["abc", "abcab", "cabbca", "bcbcab"]:
        best = max((seg for seg in _segmentations(word) if all(p in model.scores for p in seg)),
                   key=lambda seg: sum(model.scores[p] for p in seg))
        assert math.isclose(model.score(model.tokenize(word)), sum(model.scores[p] for p in best))
    assert model.tokenize("axyb") == ["a", "xy", "b"]  # the unknown run is fused, kept as text (as in HF)
    assert model.tokenize_ids("axyb") == [1, 0, 2]


def _segmentations(word):
    for cuts in itertools.product([0, 1], repeat=len(word) - 1):
        seg, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                seg.append(word[start:i])
                start = i
        yield seg + [word[start:]]


def test_unigram_works_without_spaces(unigram):
    text = "日本語のテキストにはスペースがない"
    ids = unigram.encode(text, add_special_tokens=False)
    assert unigram.unk_token_id in ids  # characters never seen in training: unknown, and no crash
    tok = train_tokenizer(["東京は日本の首都です。", "京都は古い都です。", "日本の首都は東京です。"] * 5, "unigram", 60)
    ids = tok.encode("東京は日本の首都です。", add_special_tokens=False)
    assert tok.unk_token_id not in ids and tok.decode(ids) == "東京は日本の首都です。"


def test_pair_encoding_type_ids_truncation_padding(wordpiece):
    enc = wordpiece.encode_plus("first sentence here", pair="and the second")
    cls, sep = wordpiece.cls_token_id, wordpiece.sep_token_id
    assert enc.ids[0] == cls and enc.ids.count(sep) == 2 and enc.ids[-1] == sep
    first_sep = enc.ids.index(sep)
    assert enc.type_ids == [0] * (first_sep + 1) + [1] * (len(enc.ids) - first_sep - 1)
    long = "word " * 200
    assert len(wordpiece.encode(long)) > 200  # no truncation unless asked
    assert len(wordpiece.encode(long, truncation=True, max_length=16)) == 16
    batch = wordpiece(["short", "a much longer sentence than that"], padding=True)
    n = len(batch["input_ids"][1])
    k = len(wordpiece.encode("short"))
    assert len(batch["input_ids"][0]) == n and batch["attention_mask"][0] == [1] * k + [0] * (n - k)
    assert batch["input_ids"][0][-1] == wordpiece.pad_token_id
    assert wordpiece.encode_batch(["short", "longer one here"]) == [wordpiece.encode("short"),
                                                                    wordpiece.encode("longer one here")]


def test_char_and_word_tokenizers_have_unk():
    char = train_tokenizer(["hello world"], "char", 100)
    assert char.decode(char.encode("hold")) == "hold"
    assert char.encode("z") == [char.unk_token_id]
    word = train_tokenizer(["the cat sat on the mat"], "word", 100)
    assert word.encode("the dog") == [word.token_to_id("the"), word.unk_token_id]
    assert word.decode(word.encode("the cat")) == "the cat"


def test_save_load_roundtrip(tmp_path, bpe, wordpiece, unigram):
    for tok in (bpe, wordpiece, unigram):
        path = tok.save(tmp_path / type(tok.model).__name__)
        back = load_tokenizer(path)
        assert back.to_json() == tok.to_json()
        assert back.encode(TEXTS[3]) == tok.encode(TEXTS[3])
        assert load_tokenizer(tmp_path / type(tok.model).__name__).vocab_size == tok.vocab_size


def test_unsupported_component_is_named(bpe):
    d = bpe.to_json()
    d["normalizer"] = {"type": "Unidecode"}
    with pytest.raises(TokenizerError, match="Unidecode"):
        tokenizer_from_json(d)
    d = bpe.to_json()
    d["pre_tokenizer"] = {"type": "Morfessor"}
    with pytest.raises(LmkitError, match="Morfessor"):
        tokenizer_from_json(d)


def test_load_errors_are_user_errors(tmp_path):
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError):
        train_tokenizer(["x"], "bpe", 100)  # below 256 bytes + specials


def test_parallel_batch_equals_sequential(wordpiece, monkeypatch):
    import lmkit.tokenizers.fast as fast
    monkeypatch.setattr(fast, "PARALLEL_MIN_CHARS", 1)
    texts = TEXTS[:12]
    assert wordpiece.encode_batch(texts, num_workers=2) == [wordpiece.encode(t) for t in texts]


def test_roles_and_sizes(bpe, wordpiece, unigram):
    assert bpe.eos_token_id == bpe.token_to_id("<|endoftext|>") and bpe.pad_token_id == bpe.token_to_id("<|pad|>")
    assert (wordpiece.pad_token_id, wordpiece.unk_token_id, wordpiece.cls_token_id, wordpiece.sep_token_id,
            wordpiece.mask_token_id) == (0, 1, 2, 3, 4)
    assert unigram.eos_token_id == unigram.token_to_id("</s>") and unigram.unk_token_id is not None
    assert bpe.vocab_size == 600 and len(json.loads(bpe.to_str())["model"]["merges"]) == 600 - 258


def test_pickles_for_worker_processes(bpe):
    import pickle
    back = pickle.loads(pickle.dumps(bpe))
    assert back.encode(TEXTS[1]) == bpe.encode(TEXTS[1]) and back.pad_token_id == bpe.pad_token_id


def test_cli_train_and_encode(tmp_path, capsys):
    from lmkit.cli import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(TEXTS[:6]), encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--kind", "wordpiece", "--vocab-size", "400", "--corpus", str(corpus),
                 "--out", str(out), "--no-progress"]) == 0
    tok = load_tokenizer(out)
    assert tok.vocab_size == 400
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "hello", "world"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == " ".join(map(str, tok.encode("hello world")))
    assert main(["tokenizer", "encode", "--tokenizer", str(tmp_path / "missing"), "x"]) == 2


def test_add_special_tokens_gets_new_ids_and_is_never_split():
    tok = train_tokenizer(TEXTS[:5], "bpe", 300)
    n = tok.vocab_size
    ids = tok.add_special_tokens(["<extra_id_0>", "<extra_id_1>", "<|endoftext|>"])
    assert ids == [n, n + 1, tok.token_to_id("<|endoftext|>")] and tok.vocab_size == n + 2
    assert tok.encode("a<extra_id_1>b")[1] == n + 1
    assert tok.decode(tok.encode("a<extra_id_0> b")) == "a<extra_id_0> b"


def _word_lattices(words, scores):
    """WordLattices over `words` ([(word, count)]) with an edge per occurrence of each piece of `scores`."""
    import numpy as np
    from lmkit.tokenizers.trainers.lattice import WordLattices
    names = sorted(scores)
    starts, ends, pos, length, pid, at = [], [], [], [], [], 0
    for w, _ in words:
        starts.append(at)
        ends.append(at + len(w))
        for i in range(len(w)):
            for j in range(i + 1, len(w) + 1):
                if w[i:j] in scores:
                    pos.append(at + i), length.append(j - i), pid.append(names.index(w[i:j]))
        at += len(w) + 1
    arr = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    lat = WordLattices(arr(starts), arr(ends), arr([c for _, c in words]), at, arr(pos), arr(length), arr(pid))
    return lat, names, np.array([scores[n] for n in names])


def test_unigram_estep_is_exact_posterior_and_viterbi_the_best_path():
    import numpy as np
    scores = {"a": -1.0, "b": -1.5, "ab": -2.2, "c": -2.0, "bc": -2.4, "abc": -4.1, "ca": -2.9}
    words = [("abc", 3), ("cab", 2), ("abcab", 1), ("c", 4)]
    lat, names, s = _word_lattices(words, scores)
    expected = dict(zip(names, np.bincount(lat.pid, weights=lat.marginals(s[lat.pid]), minlength=len(names))))
    brute, best = Counter(), Counter()
    for w, c in words:
        segs = [g for g in _segmentations(w) if all(p in scores for p in g)]
        weights = [math.exp(sum(scores[p] for p in g)) for g in segs]
        z = sum(weights)
        for g, wt in zip(segs, weights):
            for p in g:
                brute[p] += c * wt / z
        for p in max(segs, key=lambda g: sum(scores[p] for p in g)):
            best[p] += c
    assert all(math.isclose(expected[p], brute[p], rel_tol=1e-12) for p in scores)
    edges, ws = lat.viterbi(s[lat.pid])
    got = Counter()
    for e, w in zip(edges, ws):
        got[names[lat.pid[e]]] += words[w][1]
    assert got == best


def test_unigram_digamma_is_the_one_tokenizers_uses():
    """tokenizers' psi: the recurrence up to x >= 7, then the series in x - 1/2 (accurate to about 1e-10)."""
    from lmkit.tokenizers.trainers.unigram import digamma
    assert math.isclose(digamma(1.0), -0.5772156649015329, rel_tol=1e-9)  # -Euler-Mascheroni
    assert digamma(1.0) == -0.5772156649542974  # this series' value (5e-11 off the true one), pinned
    assert all(math.isclose(digamma(x + 1), digamma(x) + 1 / x, rel_tol=1e-9) for x in (0.3, 2.5, 7.0, 40.0))
    assert list(digamma([0.5, 1e6])) == [digamma(0.5), digamma(1e6)]


def test_added_token_that_is_also_a_merge_stays_whole(bpe):
    word = max((t for t in bpe.model.vocab if len(t) > 3 and t.isalpha()), key=len)
    tok = tokenizer_from_json(bpe.to_json())
    tok.add_special_tokens([word])
    text = f"x{word}y {word}"
    assert tok.engine() is not None
    assert tok.encode(text).count(tok.token_to_id(word)) == 2
    assert tok.encode(text) == tok._encode_plain(text, python_only=True)


def test_unigram_vocabulary_too_small_for_the_characters_is_an_error():
    """Every character is a Unigram piece, so a vocabulary smaller than the alphabet cannot be honoured (HF refuses)."""
    texts = ["abcdefghij klmnopqrst uvwxyz"]  # 26 letters and the metaspace
    with pytest.raises(TokenizerError, match="27 distinct characters and 2 special tokens; use vocab_size >= 29"):
        train_tokenizer(texts, kind="unigram", vocab_size=20, special_tokens=["<unk>", "<pad>"])
    assert train_tokenizer(texts, kind="unigram", vocab_size=29, special_tokens=["<unk>", "<pad>"]).vocab_size == 29
