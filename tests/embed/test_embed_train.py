"""word2vec training: vocabulary, subsampling and noise against gensim's tables, the Huffman tree against
gensim's, the CLI's files (read back by gensim), and vectors that agree with gensim's Word2Vec as much as gensim's
own runs with another seed agree with each other."""
from itertools import combinations

import numpy as np
import pytest

gensim_models = pytest.importorskip("gensim.models")
from gensim.test.utils import datapath  # noqa: E402

from lmkit.cli import main  # noqa: E402
from lmkit.embed import Vocabulary, Word2Vec, Word2VecConfig, WordVectors, sentences_of  # noqa: E402
from lmkit.embed.vocab import huffman_paths  # noqa: E402


@pytest.fixture(scope="module")
def lee():
    with open(datapath("lee_background.cor"), encoding="utf-8") as f:
        return list(sentences_of(f.read().splitlines()[:120]))


def test_vocabulary_subsampling_and_noise_match_gensim(lee):
    vocab = Vocabulary.build(lee, min_count=3)
    model = gensim_models.Word2Vec(vector_size=8, min_count=3, sample=1e-3, negative=5)
    model.build_vocab(lee)
    wv = model.wv
    assert vocab.words == wv.index_to_key  # the same order, equal counts included
    assert [vocab.counts[vocab.index()[w]] for w in wv.index_to_key] == [wv.get_vecattr(w, "count") for w in wv.index_to_key]
    ours = dict(zip(vocab.words, vocab.keep_probabilities(1e-3)))
    theirs = {w: wv.get_vecattr(w, "sample_int") / (2**32 - 1) for w in wv.index_to_key}
    assert max(abs(ours[w] - theirs[w]) for w in theirs) < 1e-6
    assert min(ours.values()) < 0.5  # the frequent words really are subsampled
    gensim_noise = np.diff(np.concatenate(([0], model.cum_table))) / model.cum_table[-1]
    noise = np.diff(np.concatenate(([0], vocab.noise_cumulative(0.75))))
    ours_by_word = dict(zip(vocab.words, noise))
    np.testing.assert_allclose([ours_by_word[w] for w in wv.index_to_key], gensim_noise, atol=1e-8)
    keep, alias = vocab.noise_alias(0.75)  # the table the kernel draws from: P(w) = (keep_w + sum_{alias j = w} (1 - keep_j)) / V
    implied = (keep + np.bincount(alias, weights=1.0 - keep, minlength=len(keep))) / len(keep)
    np.testing.assert_allclose(implied, noise, atol=1e-12)
    assert (keep < 1).sum() > len(keep) // 2  # most columns really share with an alias


def test_huffman_codes_are_optimal_and_prefix_free(lee):
    vocab = Vocabulary.build(lee, min_count=2)
    points, codes, lengths = huffman_paths(vocab.counts)
    strings = ["".join(str(int(c)) for c in codes[w, :lengths[w]]) for w in range(len(vocab))]
    assert len(set(strings)) == len(strings)
    ordered = sorted(strings)
    assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))
    assert (points[:, 0] == points[0, 0]).all() and points.max() == len(vocab) - 2  # one root; V - 1 inner nodes
    model = gensim_models.Word2Vec(vector_size=8, min_count=2, hs=1, negative=0)
    model.build_vocab(lee)
    theirs = sum(model.wv.get_vecattr(w, "count") * len(model.wv.get_vecattr(w, "code")) for w in model.wv.index_to_key)
    assert int((vocab.counts * lengths).sum()) == theirs  # the same (optimal) expected code length
    # the same tree: the same vocabulary order, and gensim's numbering of inner nodes and order of equal counts
    assert vocab.words == model.wv.index_to_key
    for i, w in enumerate(vocab.words):
        assert codes[i, :lengths[i]].tolist() == model.wv.get_vecattr(w, "code").tolist(), w
        assert points[i, :lengths[i]].tolist() == model.wv.get_vecattr(w, "point").tolist(), w


def agreement(a, b, words):
    """Spearman correlation between the cosines two sets of vectors give the same word pairs."""
    from scipy.stats import spearmanr

    pairs = list(combinations(words, 2))
    return spearmanr([a.similarity(x, y) for x, y in pairs], [float(b.similarity(x, y)) for x, y in pairs])[0]


@pytest.mark.parametrize("kind", [dict(sg=True), dict(sg=False), dict(sg=True, hs=True, negative=0)],
                         ids=["skipgram-neg", "cbow-neg", "skipgram-hs"])
def test_vectors_agree_with_gensim_within_its_own_seed_noise(lee, kind):
    settings = dict(dim=32, window=5, min_count=3, sample=1e-3, epochs=5, **kind)
    # a seed neither gensim run uses: with the same vocabulary order, the same seed draws the same initial
    # vectors (up to scale) on both sides, which would make the two agree more than training alone does
    ours = Word2Vec(Word2VecConfig(threads=1, seed=3, **settings)).train(lee)[0]

    def gensim_run(seed):
        return gensim_models.Word2Vec(lee, vector_size=32, window=5, min_count=3, sample=1e-3, epochs=5,
                                      sg=int(settings["sg"]), hs=int(settings.get("hs", False)),
                                      negative=settings.get("negative", 5), workers=1, seed=seed).wv

    g1, g2 = gensim_run(1), gensim_run(2)
    frequent = [w for w in ours.words[:400] if w in g1][15:75]  # past the stop words
    between = agreement(ours, g1, frequent)
    within = agreement(g2, g1, frequent)
    assert between > 0.8 * within, (between, within)


def test_one_thread_repeats_itself_and_threads_share_the_work(lee):
    cfg = dict(dim=16, min_count=3, epochs=1, seed=7)
    a = Word2Vec(Word2VecConfig(threads=1, **cfg)).train(lee)[0]
    b = Word2Vec(Word2VecConfig(threads=1, **cfg)).train(lee)[0]
    assert np.array_equal(a.vectors, b.vectors)
    c, report = Word2Vec(Word2VecConfig(threads=2, **cfg)).train(lee)
    assert c.words == a.words
    assert report.words == sum(1 for s in lee for w in s if w in a.index)  # every chunk trained once
    moved = np.abs(c.vectors - a.vectors).max()
    assert 0 < moved < 1  # another interleaving of the updates, the same training


def test_cli_writes_vectors_gensim_reads(tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(["der straße entlang läuft das kätzchen über die brücke"] * 30
                                + ["the cat sat on the mat and the dog sat on the log"] * 30), encoding="utf-8")
    out = tmp_path / "vec"
    assert main(["embed", "train", "--corpus", str(corpus), "--out", str(out), "--dim", "12", "--epochs", "2",
                 "--min-count", "2", "--cbow", "--hs", "--threads", "1"]) == 0
    vectors = WordVectors.load(out)
    assert "straße" in vectors and "über" in vectors and vectors.dim == 12
    kv = gensim_models.KeyedVectors.load_word2vec_format(str(out / "vectors.txt"))
    assert kv.index_to_key == vectors.words and np.array_equal(kv.vectors, vectors.vectors)
    assert vectors.counts[vectors.index["the"]] == 120
    capsys.readouterr()
    assert main(["embed", "similar", "--vectors", str(out), "cat", "--topn", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["embed", "train", "--corpus", str(corpus), "--out", str(out), "--negative", "0"]) == 2
    assert "--hs" in capsys.readouterr().err
