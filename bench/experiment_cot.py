"""Chain of thought at small scale: one small decoder trained for the same compute on addition written as steps and
on answers alone, both scored through `lmkit harness` on addition_cot_d1..d4 and addition_direct_d1..d4.

The two corpora hold the same problems (seeded, 1 to 4 digits, the harness's test problems left out) in the
prompt format of the harness tasks, "Question: 15+27\\nAnswer: ...", problems of a document separated by blank
lines. In `cot.jsonl` the answer is the worked trace (`15+27 = (10+5)+(20+7) = 30+12 = 42. The answer is 42.`),
in `direct.jsonl` it is `The answer is 42.` alone. Both runs use the same preset, steps, batch and sequence length
(the same tokens seen, so the same compute); the direct corpus packs more problems into those tokens. Training is
`lmkit train` on one thread (OMP_NUM_THREADS=1), untimed; the result is a function of the flags and seeds.

    python bench/experiment_cot.py [--out runs/cot-experiment] [--steps 1000] [--limit 100]

Prints the table of exact match (strict "The answer is N" and flexible last-number extraction) by digits, for each
trained model under both prompts, and writes it to OUT/table.md with the results JSON of each harness run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from lmkit.evaluate.harness_tasks.lmkit_tasks import addition, addition_problems, addition_trace

DIGITS = (1, 2, 3, 4)
PROBLEMS_PER_DOCUMENT = 16


def held_out(digits: int) -> set[tuple[int, int]]:
    """The test problems of addition_*_d{digits}: never trained on."""
    return {tuple(map(int, row["question"].split("+"))) for row in addition(digits)["test"]}


def training_problems(count: int, seed: int) -> list[tuple[int, int]]:
    """`count` problems per number of digits, shuffled together; one digit has few problems outside the test
    set (50 of 81), which repeat."""
    rng = random.Random(f"cot-corpus-{seed}")
    out: list[tuple[int, int]] = []
    for d in DIGITS:
        avoid = held_out(d)
        pool = addition_problems(d, count, rng, avoid=avoid)
        out += [pool[i % len(pool)] for i in range(count)]
    rng.shuffle(out)
    return out


def write_corpora(folder: Path, count: int, seed: int) -> dict[str, Path]:
    """cot.jsonl and direct.jsonl: the same problems, in the same documents, answered two ways."""
    folder.mkdir(parents=True, exist_ok=True)
    problems = training_problems(count, seed)
    answers = {"cot": addition_trace, "direct": lambda a, b: f"The answer is {a + b}."}
    paths = {}
    for kind, answer in answers.items():
        lines = []
        for start in range(0, len(problems), PROBLEMS_PER_DOCUMENT):
            block = problems[start:start + PROBLEMS_PER_DOCUMENT]
            text = "\n\n".join(f"Question: {a}+{b}\nAnswer: {answer(a, b)}" for a, b in block)
            lines.append(json.dumps({"id": f"{kind}-{start // PROBLEMS_PER_DOCUMENT}", "text": text}))
        paths[kind] = folder / f"{kind}.jsonl"
        tmp = paths[kind].with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, paths[kind])
    return paths


def lmkit(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "lmkit", *args], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/cot-experiment")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--problems", type=int, default=30000, help="training problems per number of digits")
    ap.add_argument("--limit", type=int, default=100, help="test problems per task (of 200; 31 for one digit)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    corpora = write_corpora(out / "corpus", args.problems, args.seed)
    for kind, corpus in corpora.items():
        model = out / f"model-{kind}"
        if not (model / "model.safetensors").is_file():
            lmkit("train", "--preset", args.preset, "--corpus", str(corpus), "--out", str(model),
                  "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                  "--lr", str(args.lr), "--precision", "fp32", "--seed", str(args.seed), "--log-every", "50")
    tasks = ",".join(f"addition_{p}_d{d}" for p in ("cot", "direct") for d in DIGITS)
    scores: dict[str, dict] = {}
    for kind in corpora:
        result = out / f"harness-{kind}.json"
        if not result.is_file():
            lmkit("harness", "--model", str(out / f"model-{kind}"), "--tasks", tasks, "--limit", str(args.limit),
                  "--batch-size", "16", "--output", str(result))
        scores[kind] = json.loads(result.read_text(encoding="utf-8"))["results"]
    table = results_table(scores)
    print(table)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")


def results_table(scores: dict[str, dict]) -> str:
    """Markdown: one row per (trained on, prompt), strict / flexible exact match per number of digits."""
    head = "| trained on | prompt | " + " | ".join(f"{d} digit{'s' * (d > 1)}" for d in DIGITS) + " |"
    rows = [head, "| --- | --- |" + " ---: |" * len(DIGITS)]
    for kind, results in scores.items():
        for prompt in ("cot", "direct"):
            cells = []
            for d in DIGITS:
                r = results[f"addition_{prompt}_d{d}"]
                cells.append(f"{r['exact_match,strict-match']:.2f} / {r['exact_match,flexible-extract']:.2f}")
            trained = {"cot": "step-by-step traces", "direct": "answers alone"}[kind]
            rows.append(f"| {trained} | {prompt} exemplars | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
