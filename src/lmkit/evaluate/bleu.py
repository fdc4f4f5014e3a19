"""Corpus BLEU through sacrebleu: the score `sacrebleu REF < HYP` prints for the same lines.

BLEU = BP * exp(sum_n 1/4 log p_n), p_n the clipped n-gram precisions (n = 1..4) pooled over the
corpus and BP = min(1, exp(1 - r / c)) for reference length r and hypothesis length c.
"""
from __future__ import annotations

from typing import Sequence

from lmkit.errors import MetricError


def _streams(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """References as sacrebleu's streams: one list per reference set, each as long as the hypotheses."""
    references = list(references)
    if references and (isinstance(references[0], str) or references[0] is None):
        streams = [references]
    else:
        streams = [list(r) for r in references]
    if not streams:
        raise MetricError("BLEU needs at least one set of references")
    for s in streams:
        if len(s) != len(hypotheses):
            raise MetricError(f"{len(hypotheses)} hypotheses but a reference set of {len(s)} lines; "
                              "give one reference line per hypothesis")
        bad = next((x for x in s if x is not None and not isinstance(x, str)), None)
        if bad is not None:
            raise MetricError(f"references must be strings (or None for a missing one), got {type(bad).__name__}")
    for i, refs in enumerate(zip(*streams)):
        if all(x is None for x in refs):
            raise MetricError(f"hypothesis {i} has no reference (None in every reference set); "
                              "give at least one reference line, '' for an empty one")
    return streams


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]],
                tokenize: str = "13a", lowercase: bool = False, smooth_method: str = "exp",
                smooth_value: float | None = None, max_ngram_order: int = 4, effective_order: bool = False):
    """sacrebleu's BLEUScore (.score, .precisions, .bp, .sys_len, .ref_len) of the corpus.

    tokenize, lowercase, smooth_method ("exp", "floor", "add-k", "none"), smooth_value, max_ngram_order
    and effective_order mean what they mean to sacrebleu's `BLEU`.

    references: one string per hypothesis, or several such lists (several references each;
    None in a list where a hypothesis has fewer references).
    """
    from sacrebleu.metrics import BLEU

    hypotheses = list(hypotheses)
    if not hypotheses:
        raise MetricError("BLEU needs at least one hypothesis and reference")
    bad = [h for h in hypotheses if not isinstance(h, str)]
    if bad:
        raise MetricError(f"hypotheses must be strings, got {type(bad[0]).__name__}")
    streams = _streams(hypotheses, references)
    if smooth_method not in BLEU.SMOOTH_DEFAULTS:
        raise MetricError(f"unknown smooth_method {smooth_method!r}; choose one of {', '.join(BLEU.SMOOTH_DEFAULTS)}")
    if isinstance(max_ngram_order, bool) or not isinstance(max_ngram_order, int) or max_ngram_order < 1:
        raise MetricError(f"max_ngram_order must be a positive integer, got {max_ngram_order!r}")
    try:
        bleu = BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method, smooth_value=smooth_value,
                    max_ngram_order=max_ngram_order, effective_order=effective_order)
    except KeyError:
        raise MetricError(f"unknown BLEU tokenizer {tokenize!r}; choose one of "
                          f"{', '.join(BLEU.TOKENIZERS)}") from None
    except (ImportError, RuntimeError) as exc:  # ja-mecab, ko-mecab, flores*/spm need extra packages
        raise MetricError(f"BLEU tokenizer {tokenize!r} is not available here: "
                          f"{' '.join(str(exc).split())}") from None
    return bleu.corpus_score(hypotheses, streams)
