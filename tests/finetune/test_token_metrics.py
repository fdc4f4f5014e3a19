"""Entity-level precision / recall / F1 of token classification equal seqeval's (default mode) on random tag
sequences with stray I- tags, type changes and the E-/S- tags."""
from __future__ import annotations

import random

import pytest

from lmkit.finetune.metrics import entities, entity_scores


def random_tags(rng: random.Random, n: int, prefixes: str) -> list[str]:
    return [rng.choice(["O", "O"] + [f"{p}-{t}" for p in prefixes for t in ("MOD", "FUNC", "CLS")]) for _ in range(n)]


@pytest.mark.parametrize("prefixes", ["BI", "BIES"])
def test_entity_scores_equal_seqeval(prefixes):
    seqeval = pytest.importorskip("seqeval.metrics")
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(0)
    for trial in range(60):
        gold = [random_tags(rng, rng.randint(0, 12), prefixes) for _ in range(rng.randint(1, 6))]
        pred = [[t if rng.random() < 0.6 else random_tags(rng, 1, prefixes)[0] for t in s] for s in gold]
        for s in gold:
            assert entities(s) == get_entities(s)
        ours = entity_scores(pred, gold)
        assert ours["precision"] == pytest.approx(seqeval.precision_score(gold, pred, zero_division=0))
        assert ours["recall"] == pytest.approx(seqeval.recall_score(gold, pred, zero_division=0))
        assert ours["f1"] == pytest.approx(seqeval.f1_score(gold, pred, zero_division=0))
        if any(gold):
            assert ours["accuracy"] == pytest.approx(seqeval.accuracy_score(gold, pred))
