"""The compiled word2vec kernel against word2vec's loop written out in numpy (float64): subsampling, the
reduced windows inside sentences, the negative-sampling and hierarchical-softmax steps pair after pair, and
the random draws, for skip-gram and CBOW."""
import numpy as np
import pytest

pytest.importorskip("numba")
from lmkit.embed import Vocabulary  # noqa: E402
from lmkit.embed.kernel import MAX_EXP, train_chunk  # noqa: E402
from lmkit.embed.vocab import huffman_paths  # noqa: E402

M64 = (1 << 64) - 1


class SplitMix64:
    """splitmix64 (Steele, Lea and Flood): add the gamma, then mix; a draw keeps the top 32 bits."""

    def __init__(self, seed: int):
        self.state = seed

    def bits(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return (z ^ (z >> 31)) >> 32

    def uniform(self) -> float:
        return self.bits() / 2**32

    def below(self, n: int) -> int:
        return self.bits() % n


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def reference_chunk(ids, sentence_of, keep, W, neg, alias_keep, alias, negative, hs, points, codes, lengths,
                    sg, window, lr, seed):
    """The textbook loop. Returns how many words survived subsampling and how many hierarchical-softmax
    nodes were skipped; updates W, neg, hs in place."""
    rng = SplitMix64(seed)
    skipped = [0]
    kept = [(w, s) for w, s in zip(ids, sentence_of) if rng.uniform() < keep[w]]
    words, sents = [w for w, _ in kept], [s for _, s in kept]

    def step(h, centre):
        e = np.zeros_like(h)
        for node, code in zip(points[centre, :lengths[centre]] if len(lengths) else [],
                              codes[centre, :lengths[centre]] if len(lengths) else []):
            f = hs[node] @ h
            if abs(f) >= MAX_EXP:
                skipped[0] += 1
                continue
            g = lr * (1 - code - sigmoid(f))
            e += g * hs[node]
            hs[node] += g * h
        for n in range(negative + 1) if negative else []:
            if n == 0:
                row, label = centre, 1.0
            else:
                x = rng.uniform() * len(alias)
                j = min(int(x), len(alias) - 1)
                row = j if x - j < alias_keep[j] else alias[j]
                if row == centre:
                    continue
                label = 0.0
            g = lr * (label - sigmoid(neg[row] @ h))
            e += g * neg[row]
            neg[row] += g * h
        return e

    for i, centre in enumerate(words):
        b = 1 + rng.below(window)
        near = [words[j] for j in range(max(0, i - b), min(len(words), i + b + 1)) if j != i and sents[j] == sents[i]]
        if sg:
            for word in near:  # the context word's input vector predicts the centre
                W[word] += step(W[word].copy(), centre)
        elif near:
            e = step(W[near].mean(0), centre)
            for word in near:
                W[word] += e
    return len(words), skipped[0]


def case(sg, negative, use_hs, V=12, d=8, n=60, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.sort(rng.integers(1, 200, V))[::-1]
    vocab = Vocabulary([f"w{i}" for i in range(V)], counts)
    alias_keep, alias = vocab.noise_alias(0.75) if negative else (np.zeros(0), np.zeros(0, np.int64))
    points, codes, lengths = huffman_paths(counts) if use_hs else (
        np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32), np.zeros(0, np.int64))
    scale = 1.5  # large enough that some hierarchical-softmax scores pass MAX_EXP and are skipped
    return dict(ids=rng.integers(0, V, n), sentence_of=np.repeat(np.arange(4), [20, 1, 27, 12]),
                keep=rng.uniform(0.4, 1.0, V), W=(scale * rng.standard_normal((V, d))).astype(np.float32),
                neg=(scale * rng.standard_normal((V if negative else 0, d))).astype(np.float32),
                alias_keep=alias_keep, alias=alias, negative=negative,
                hs=(scale * rng.standard_normal((V - 1 if use_hs else 0, d))).astype(np.float32),
                points=points, codes=codes, lengths=lengths, sg=sg, window=3, lr=0.05, seed=123456789)


@pytest.mark.parametrize("sg,negative,use_hs", [(True, 4, False), (True, 3, True), (False, 4, False), (False, 0, True)],
                         ids=["skipgram-neg", "skipgram-hs-neg", "cbow-neg", "cbow-hs"])
def test_kernel_is_the_per_pair_sgd_loop(sg, negative, use_hs):
    args = case(sg, negative, use_hs)
    ref = {k: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype == np.float32 else v for k, v in args.items()}
    W0 = args["W"].copy()
    kept = train_chunk(*args.values())
    ref_kept, skipped = reference_chunk(*ref.values())
    assert kept == ref_kept
    assert 0 < kept < len(args["ids"])  # subsampling dropped some words and kept the rest
    for name in ("W", "neg", "hs"):
        np.testing.assert_allclose(args[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert np.abs(args["W"] - W0).max() > 1e-2  # the input vectors did move
    assert (skipped > 0) == use_hs  # some nodes were past MAX_EXP: the case exercises that branch


def test_kernel_subsamples_with_the_keep_probability():
    args = case(True, 1, False, V=3)
    args["ids"] = np.repeat(np.arange(3), 20000)
    args["sentence_of"] = np.arange(60000)  # one-word sentences: no pairs, subsampling only
    args["keep"] = np.array([0.3, 1.0, 0.0])
    W0 = args["W"].copy()
    kept = train_chunk(*args.values())
    assert abs((kept - 20000) - 0.3 * 20000) < 4 * np.sqrt(20000 * 0.3 * 0.7)
    assert np.array_equal(args["W"], W0)  # no word had a neighbour in its sentence
    args["keep"] = np.ones(3)
    assert train_chunk(*args.values()) == 60000
