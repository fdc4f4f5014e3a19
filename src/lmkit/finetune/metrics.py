"""Classification metrics: accuracy = mean(pred == gold); macro-F1 = mean over classes of
2 P R / (P + R), with P = TP / (TP + FP), R = TP / (TP + FN) and F1 = 0 where TP = 0."""
from __future__ import annotations


def accuracy(pred: list[int], gold: list[int]) -> float:
    if len(pred) != len(gold) or not gold:
        raise ValueError("accuracy needs two equally long, non-empty label lists")
    return sum(p == g for p, g in zip(pred, gold)) / len(gold)


def macro_f1(pred: list[int], gold: list[int], num_labels: int | None = None) -> float:
    """Unweighted mean of per-class F1 over the classes seen in gold or pred (or 0..num_labels-1)."""
    if len(pred) != len(gold) or not gold:
        raise ValueError("macro-F1 needs two equally long, non-empty label lists")
    classes = range(num_labels) if num_labels else sorted(set(gold) | set(pred))
    scores = []
    for c in classes:
        tp = sum(p == c and g == c for p, g in zip(pred, gold))
        fp = sum(p == c and g != c for p, g in zip(pred, gold))
        fn = sum(p != c and g == c for p, g in zip(pred, gold))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores)
