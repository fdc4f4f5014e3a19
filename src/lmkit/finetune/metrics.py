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


# entity-level scores of token classification (NER), as seqeval computes them by default (IOB2, conlleval's rules)

def _chunk_ends(prev: str, tag: str, prev_type: str, kind: str) -> bool:
    return (prev in "ES" or (prev in "BI" and tag in "BSO")) or (prev not in "O." and prev_type != kind)


def _chunk_starts(prev: str, tag: str, prev_type: str, kind: str) -> bool:
    return tag in "BS" or (prev in "ESO" and tag in "EI") or (tag not in "O." and prev_type != kind)


def entities(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each entity in one sentence's tags (B-X, I-X, E-X, S-X, O): a chunk ends where
    conlleval ends one (an O, a B or S after B/I, a change of type, after E or S) and starts at B, S, an I or E after
    O/E/S, or a change of type, so a stray I-X opens an entity, as seqeval's default mode reads it."""
    out, prev, prev_type, begin = [], "O", "", 0
    for i, chunk in enumerate(list(tags) + ["O"]):
        tag, kind = chunk[0], chunk[1:].split("-", maxsplit=1)[-1] or "_"
        if _chunk_ends(prev, tag, prev_type, kind):
            out.append((prev_type, begin, i - 1))
        if _chunk_starts(prev, tag, prev_type, kind):
            begin = i
        prev, prev_type = tag, kind
    return out


def entity_scores(pred: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """Micro precision, recall and F1 over entities (exact type and span), and token accuracy, of sentences."""
    if len(pred) != len(gold) or any(len(p) != len(g) for p, g in zip(pred, gold)):
        raise ValueError("entity scores need predicted and gold tags of the same sentences and lengths")
    found = {(s, *e) for s, tags in enumerate(pred) for e in entities(tags)}
    true = {(s, *e) for s, tags in enumerate(gold) for e in entities(tags)}
    right = len(found & true)
    p = right / len(found) if found else 0.0
    r = right / len(true) if true else 0.0
    tokens = sum(len(g) for g in gold)
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0,
            "accuracy": sum(a == b for x, y in zip(pred, gold) for a, b in zip(x, y)) / max(tokens, 1)}


# extractive QA: the official SQuAD v1.1 evaluation script's exact match and F1 (as `evaluate`'s "squad" metric)

def normalize_answer(s: str) -> str:
    """Lower case, punctuation and the articles a / an / the removed, whitespace collapsed."""
    import re
    import string

    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def squad_f1(prediction: str, truth: str) -> float:
    """2 P R / (P + R) over the normalized tokens both share (as multisets); 0 when none is shared."""
    from collections import Counter

    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def squad_scores(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
    """{"exact_match", "f1"} in percent: each question's best over its gold answers, averaged over `answers`'
    questions (an unanswered one scores 0)."""
    em = f1 = 0.0
    for qid, truths in answers.items():
        pred = predictions.get(qid, "")
        em += max(float(normalize_answer(pred) == normalize_answer(t)) for t in truths)
        f1 += max(squad_f1(pred, t) for t in truths)
    n = max(len(answers), 1)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n}
