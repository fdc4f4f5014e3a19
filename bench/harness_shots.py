"""Scores against the number of shots: `lmkit harness` at 0, 1 and 5 exemplars on lmkit's offline tasks, for each
model folder given (the demo model and its instruction-tuned version: `lmkit demo` writes DIR and DIR/sft).

    python bench/harness_shots.py --model runs/demo --model runs/demo/sft [--chat runs/demo/sft] [--limit 100]

Each (model, shots) run is one `lmkit harness` call whose results JSON is kept under --out (an existing one is
reused); the table (markdown) is printed and written to OUT/table.md. A folder given with --chat is also run
with --apply-chat-template (the exemplars as alternating user and assistant turns).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TASKS = ["pydoc_mc", "numbers", "addition_cot_d2", "addition_direct_d2"]
SHOTS = (0, 1, 5)
# (task, metric key, column title)
COLUMNS = [("pydoc_mc", "acc,none", "pydoc_mc acc"), ("pydoc_mc", "acc_norm,none", "pydoc_mc acc_norm"),
           ("numbers", "exact_match,strip", "numbers exact"),
           ("addition_cot_d2", "exact_match,flexible-extract", "addition_cot_d2 (flexible)"),
           ("addition_direct_d2", "exact_match,flexible-extract", "addition_direct_d2 (flexible)")]


def harness(model: str, shots: int, chat: bool, out: Path, limit: int) -> dict:
    result = out / f"{model.strip('/').replace('/', '_')}{'-chat' if chat else ''}-{shots}shot.json"
    if not result.is_file():
        command = [sys.executable, "-m", "lmkit", "harness", "--model", model, "--tasks", ",".join(TASKS),
                   "--num-fewshot", str(shots), "--limit", str(limit), "--batch-size", "16", "--output", str(result)]
        if chat:
            command.append("--apply-chat-template")
        subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(result.read_text(encoding="utf-8"))["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="a model folder (repeat for several)")
    ap.add_argument("--chat", action="append", default=[], help="a folder also run through its chat template")
    ap.add_argument("--limit", type=int, default=100, help="documents per task")
    ap.add_argument("--out", default="runs/harness-shots")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(m, False) for m in args.model] + [(m, True) for m in args.chat]
    rows = ["| model | prompt | shots | " + " | ".join(c[2] for c in COLUMNS) + " |",
            "| --- | --- | ---: |" + " ---: |" * len(COLUMNS)]
    for model, chat in runs:
        for shots in SHOTS:
            results = harness(model, shots, chat, out, args.limit)
            cells = [f"{results[task][key]:.3f}" for task, key, _ in COLUMNS]
            rows.append(f"| {model} | {'chat template' if chat else 'plain'} | {shots} | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    print(table)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
