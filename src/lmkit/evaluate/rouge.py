"""ROUGE-1, ROUGE-2 and ROUGE-L precision, recall and F1, as Google's `rouge-score` computes them (no stemming).

Text is lower-cased and cut into runs of [a-z0-9]. ROUGE-N: P = |hyp n-grams ∩ ref n-grams| / |hyp n-grams|,
R = the same over |ref n-grams| (counts clipped), F1 = 2PR / (P + R). ROUGE-L: P = LCS / |hyp|,
R = LCS / |ref| with LCS the longest common subsequence of tokens. Corpus scores are the mean over pairs.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple, Sequence

from lmkit.errors import MetricError

_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def rouge_tokens(text: str) -> list[str]:
    return [t for t in _NON_ALNUM.sub(" ", text.lower()).split() if t]


class RougeScore(NamedTuple):
    """One ROUGE score with rouge-score's field names (ROUGE is recall-oriented: recall is the original measure)."""
    precision: float
    recall: float
    fmeasure: float


def _score(overlap: int, hyp_total: int, ref_total: int) -> RougeScore:
    p, r = overlap / max(hyp_total, 1), overlap / max(ref_total, 1)
    return RougeScore(p, r, 2 * p * r / (p + r) if p + r > 0 else 0.0)


def rouge_n_score(hyp: list[str], ref: list[str], n: int) -> RougeScore:
    """Precision, recall and F1 of clipped n-gram overlap between token lists."""
    h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
    r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
    return _score(sum((h & r).values()), sum(h.values()), sum(r.values()))


def rouge_n(hyp: list[str], ref: list[str], n: int) -> float:
    """F1 of clipped n-gram overlap between token lists."""
    return rouge_n_score(hyp, ref, n).fmeasure


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row at a time)."""
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1]


def rouge_l_score(hyp: list[str], ref: list[str]) -> RougeScore:
    """Precision LCS / |hyp|, recall LCS / |ref| and their F1."""
    if not hyp or not ref:
        return RougeScore(0.0, 0.0, 0.0)
    return _score(lcs_length(hyp, ref), len(hyp), len(ref))


def rouge_l(hyp: list[str], ref: list[str]) -> float:
    return rouge_l_score(hyp, ref).fmeasure


def rouge_detail(hypothesis: str, reference: str) -> dict[str, RougeScore]:
    """{"rouge1", "rouge2", "rougeL"}: precision, recall and F1 of one pair, as rouge-score's `score(ref, hyp)`."""
    h, r = rouge_tokens(hypothesis), rouge_tokens(reference)
    return {"rouge1": rouge_n_score(h, r, 1), "rouge2": rouge_n_score(h, r, 2), "rougeL": rouge_l_score(h, r)}


def rouge_scores(hypothesis: str, reference: str) -> dict[str, float]:
    """{"rouge1", "rouge2", "rougeL"} F1 of one pair, in [0, 1]."""
    return {key: score.fmeasure for key, score in rouge_detail(hypothesis, reference).items()}


def corpus_rouge(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean over pairs of each pair's ROUGE-1/2/L F1 ("rouge1" ...), precision ("rouge1_precision" ...) and recall
    ("rouge1_recall" ...), in [0, 1]."""
    if len(hypotheses) != len(references):
        raise MetricError(f"{len(hypotheses)} hypotheses but {len(references)} references; give one per hypothesis")
    if not hypotheses:
        raise MetricError("ROUGE needs at least one hypothesis and reference")
    bad = [x for x in [*hypotheses, *references] if not isinstance(x, str)]
    if bad:
        raise MetricError(f"hypotheses and references must be strings, got {type(bad[0]).__name__}")
    totals = Counter()
    for h, r in zip(hypotheses, references):
        for key, score in rouge_detail(h, r).items():
            totals.update({key: score.fmeasure, f"{key}_precision": score.precision, f"{key}_recall": score.recall})
    keys = [f"{key}{part}" for part in ("", "_precision", "_recall") for key in ("rouge1", "rouge2", "rougeL")]
    return {k: totals[k] / len(hypotheses) for k in keys}
