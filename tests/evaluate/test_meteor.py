"""METEOR equals NLTK's meteor_score: exact, Porter-stem and synonym stages (the synonyms a fixed table, given to
NLTK as a WordNet stand-in: its WordNet data is a download), chunks, several references, unicode and edge cases."""
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
