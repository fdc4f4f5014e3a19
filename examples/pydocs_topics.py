"""Build a text-classification task from the built-in corpus: which Python reference topic a paragraph comes from.

    python examples/pydocs_topics.py DIR       # writes DIR/train.jsonl and DIR/test.jsonl
    lmkit finetune --model ENCODER --train DIR/train.jsonl --eval DIR/test.jsonl --out runs/topics

Paragraphs (blocks between blank lines, at least 80 characters) of six reference topics of
`pydoc_data.topics`; a fifth of each topic's paragraphs is held out (seeded).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lmkit.data import load_corpus
from lmkit.finetune import Example, split_examples

TOPICS = ("string-methods", "debugger", "typesmapping", "formatstrings", "import", "execmodel")


def topic_examples(topics=TOPICS, min_chars: int = 80) -> list[Example]:
    docs = {d.id: d.text for d in load_corpus("pydocs")}
    out = []
    for topic in topics:
        for para in docs[f"topic:{topic}"].split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= min_chars:
                out.append(Example(text, topic))
    return out


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_examples(topic_examples(), 0.2, seed=0)
    for name, rows in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for e in rows:
                f.write(json.dumps({"text": e.text, "label": e.label}) + "\n")
        print(f"{out / name}.jsonl: {len(rows)} paragraphs")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/pydocs_topics")
