"""Labelled text for classification: CSV or JSONL rows with `text`, optional `text_pair`, and `label`."""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from lmkit.errors import CorpusError


@dataclass
class Example:
    text: str
    label: str
    text_pair: str | None = None


def read_examples(path: str | Path) -> list[Example]:
    """Rows of a .csv (with a header) or .jsonl/.json-lines file; labels are kept as strings."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path} does not exist; pass a CSV or JSONL file with text and label columns")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path} is not UTF-8 ({exc}); re-encode it as UTF-8") from None
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(content.splitlines()))
    else:
        rows = []
        for n, line in enumerate(content.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise CorpusError(f"{path}:{n} is not a JSON object ({exc}); one object per line") from None
    examples = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or row.get("text") in (None, "") or row.get("label") in (None, ""):
            raise CorpusError(f"{path}: row {n} lacks `text` or `label`; every row needs both (text_pair is optional)")
        pair = row.get("text_pair")
        examples.append(Example(str(row["text"]), str(row["label"]), str(pair) if pair not in (None, "") else None))
    if not examples:
        raise CorpusError(f"{path} holds no examples")
    return examples


def label_names(*sets: list[Example]) -> list[str]:
    """Sorted label names (numbers in numeric order): index i is class i."""
    names = {e.label for s in sets for e in s}
    numeric = all(n.lstrip("-").isdigit() for n in names)
    return sorted(names, key=lambda n: (int(n), n) if numeric else (0, n))


def split_examples(examples: list[Example], fraction: float, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded shuffle, `fraction` of each label held out (at least one where a label has two)."""
    rng = random.Random(seed)
    by_label: dict[str, list[Example]] = {}
    for e in examples:
        by_label.setdefault(e.label, []).append(e)
    train, held = [], []
    for label in sorted(by_label):
        group = by_label[label][:]
        rng.shuffle(group)
        k = max(1, round(fraction * len(group))) if len(group) > 1 else 0
        held += group[:k]
        train += group[k:]
    rng.shuffle(train)
    return train, held
