"""Corpus BLEU through sacrebleu: the score `sacrebleu REF < HYP` prints for the same lines.

BLEU = BP * exp(sum_n 1/4 log p_n), p_n the clipped n-gram precisions (n = 1..4) pooled over the
corpus and BP = min(1, exp(1 - r / c)) for reference length r and hypothesis length c.
"""
from __future__ import annotations

from typing import Sequence

from lmkit.errors import MetricError


def _streams(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """References as sacrebleu's streams: one list per reference set, each as long as the hypotheses."""
    if references and isinstance(references[0], str):
        streams = [list(references)]
    else:
        streams = [list(r) for r in references]
    for s in streams:
        if len(s) != len(hypotheses):
            raise MetricError(f"{len(hypotheses)} hypotheses but a reference set of {len(s)} lines; "
                              "give one reference line per hypothesis")
    return streams


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]],
                tokenize: str = "13a", lowercase: bool = False):
    """sacrebleu's BLEUScore (.score, .precisions, .bp, .sys_len, .ref_len) of the corpus.

    references: one string per hypothesis, or several such lists (several references each).
    """
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize=tokenize, lowercase=lowercase).corpus_score(list(hypotheses), _streams(hypotheses, references))
