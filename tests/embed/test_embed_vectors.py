"""WordVectors against gensim's KeyedVectors on the same vectors: most_similar, analogy (3CosAdd),
similarity, the word2vec text format; ties and unicode words included."""
import numpy as np
import pytest

gensim_kv = pytest.importorskip("gensim.models.keyedvectors")

from lmkit.embed import WordVectors  # noqa: E402
from lmkit.errors import ConfigError  # noqa: E402

WORDS = ["king", "queen", "man", "woman", "straße", "東京", "naïve", "café", "x_1", "über", "ñandú", "δ",
         "dup_a", "dup_b", "dup_c", "zero_like", "a'b", "k9"]


def make(seed=0, dim=7):
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((len(WORDS), dim)).astype(np.float32)
    vecs[WORDS.index("dup_b")] = vecs[WORDS.index("dup_a")]  # exact ties
    vecs[WORDS.index("dup_c")] = 2 * vecs[WORDS.index("dup_a")]  # same direction, another length: a tie in cosine
    vecs[WORDS.index("zero_like")] *= 1e-3
    ours = WordVectors(WORDS, vecs)
    theirs = gensim_kv.KeyedVectors(dim)
    theirs.add_vectors(WORDS, vecs)
    return ours, theirs


def same(a, b):
    assert [w for w, _ in a] == [w for w, _ in b]
    np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("query", [
    dict(positive=["king"]), dict(positive=["dup_a"]), dict(positive="東京", topn=3),
    dict(positive=["king", "woman"], negative=["man"]), dict(positive=["straße", "δ"], topn=50),
    dict(negative=["café"], topn=4), dict(positive=[("king", 2.0), "queen"], negative=[("man", 0.5)]),
    dict(positive=["über"], restrict_vocab=10), dict(positive=["ñandú", "naïve"], topn=1),
])
def test_most_similar_matches_gensim(seed, query):
    ours, theirs = make(seed)
    same(ours.most_similar(**query), theirs.most_similar(**query))


def test_ties_come_out_in_gensims_order():
    ours, theirs = make(3)
    ties = ours.most_similar(positive=["dup_a"], topn=len(WORDS))
    scores = dict(ties)
    assert scores["dup_b"] == pytest.approx(1.0) and scores["dup_c"] == pytest.approx(1.0)
    same(ties, theirs.most_similar(positive=["dup_a"], topn=len(WORDS)))
    same(ours.most_similar(positive=["king"], topn=len(WORDS)), theirs.most_similar(positive=["king"], topn=len(WORDS)))


def test_raw_vector_query_and_similarity():
    ours, theirs = make(4)
    v = ours["queen"] - ours["woman"]
    same(ours.most_similar(positive=[v]), theirs.most_similar(positive=[v]))
    for a, b in [("king", "queen"), ("東京", "δ"), ("dup_a", "dup_c"), ("zero_like", "k9")]:
        assert ours.similarity(a, b) == pytest.approx(float(theirs.similarity(a, b)), abs=1e-6)


def test_analogy_is_3cosadd():
    ours, theirs = make(5)
    for a, b, c in [("man", "king", "woman"), ("straße", "東京", "café"), ("dup_a", "dup_b", "δ")]:
        got = ours.analogy(a, b, c, topn=5)
        same(got, theirs.most_similar(positive=[b, c], negative=[a], topn=5))
        unit = ours.vectors / np.linalg.norm(ours.vectors, axis=1, keepdims=True)
        target = unit[ours.index[b]] - unit[ours.index[a]] + unit[ours.index[c]]
        cos = unit @ target / np.linalg.norm(target)
        cos[[ours.index[a], ours.index[b], ours.index[c]]] = -np.inf
        assert got[0][0] == WORDS[int(np.argmax(cos))]


def test_files_round_trip_and_gensim_reads_the_text_format(tmp_path):
    ours, _ = make(6)
    ours.counts = np.arange(len(WORDS), 0, -1)
    ours.save(tmp_path)
    back = WordVectors.load(tmp_path)
    assert back.words == WORDS and np.array_equal(back.vectors, ours.vectors)
    assert back.counts.tolist() == ours.counts.tolist()
    kv = gensim_kv.KeyedVectors.load_word2vec_format(str(tmp_path / "vectors.txt"), binary=False)
    assert kv.index_to_key == WORDS
    assert np.array_equal(kv.vectors, ours.vectors)  # 9 significant digits: float32 exactly
    text = WordVectors.load(tmp_path / "vectors.txt")
    assert np.array_equal(text.vectors, ours.vectors)


def test_a_word_with_a_space_cannot_go_to_the_text_format(tmp_path):
    with pytest.raises(ConfigError, match="whitespace"):
        WordVectors(["a b", "c"], np.ones((2, 3))).save_word2vec_text(tmp_path / "v.txt")
    with pytest.raises(ConfigError, match="twice"):
        WordVectors(["a", "a"], np.ones((2, 3)))


def test_a_file_that_is_not_utf8_text_is_a_one_line_error(tmp_path, capsys):
    from lmkit.cli import main
    from lmkit.errors import LmkitError

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("2 3\ncafé 1 2 3\nstraße 4 5 6\n".encode("latin-1"))
    binary = tmp_path / "vectors.bin"
    ours, theirs = make(7)
    theirs.save_word2vec_format(str(binary), binary=True)  # gensim's binary format: raw float32 after each word
    for path in (latin1, binary):
        with pytest.raises(LmkitError, match="not UTF-8") as err:
            WordVectors.load(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert main(["embed", "similar", "--vectors", str(latin1), "café"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not UTF-8" in err and str(latin1) in err and "Traceback" not in err
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\nword 1 x\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a number"):
        WordVectors.load(bad)
