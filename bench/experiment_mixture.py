"""Does code data improve reasoning? The same model and compute trained on `pydocs` alone and on mixtures with
`pycode` (`--corpus pydocs:W,pycode:1-W`, rows sampled by weight), then scored through `lmkit harness` on the
arithmetic tasks (addition_direct_d1, addition_cot_d1) and the multiple-choice `pydoc_mc`, and on pydocs'
validation loss.

    nice -n 19 python bench/experiment_mixture.py [--out runs/mixture] [--steps 300]

Prints a table and writes OUT/table.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIXTURES = {"pydocs": ["pydocs"], "pydocs 0.7 + pycode 0.3": ["pydocs:0.7,pycode:0.3"],
            "pydocs 0.5 + pycode 0.5": ["pydocs:0.5,pycode:0.5"]}
TASKS = "pydoc_mc,addition_direct_d1,addition_cot_d1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/mixture")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--limit", type=int, default=100)
    args = ap.parse_args()
    from lmkit.train import TrainConfig, train

    out = Path(args.out)
    rows = []
    for i, (name, corpus) in enumerate(MIXTURES.items()):
        model = out / f"model-{i}"
        if not (model / "model.safetensors").is_file():
            result = train(TrainConfig(preset="default", corpus=corpus, out=str(model), max_steps=args.steps,
                                       batch_size=16, seq_len=128, precision="fp32", seed=0, progress=False,
                                       model_overrides={"d_model": 128, "n_heads": 4, "n_kv_heads": None}))
            (model / "run.json").write_text(json.dumps(result))
        result = json.loads((model / "run.json").read_text())
        scores = out / f"harness-{i}.json"
        if not scores.is_file():
            subprocess.run([sys.executable, "-m", "lmkit", "harness", "--model", str(model), "--tasks", TASKS,
                            "--limit", str(args.limit), "--output", str(scores)], check=True)
        r = json.loads(scores.read_text())["results"]
        rows.append((name, result.get("val_loss"), r["pydoc_mc"]["acc,none"], r["pydoc_mc"]["acc_norm,none"],
                     r["addition_direct_d1"]["exact_match,flexible-extract"],
                     r["addition_cot_d1"]["exact_match,flexible-extract"], result.get("mixture")))
        print(rows[-1], flush=True)
    lines = ["| training text | validation loss (its own split) | pydoc_mc acc | pydoc_mc acc_norm | addition_direct_d1 "
             "| addition_cot_d1 | realised mixture |", "|---|---|---|---|---|---|---|"]
    for name, loss, acc, norm, direct, cot, mix in rows:
        shares = ", ".join(f"{k} {v:.1%}" for k, v in (mix or {}).items()) or "-"
        lines.append(f"| {name} | {loss:.3f} | {acc:.2f} | {norm:.2f} | {direct:.2f} | {cot:.2f} | {shares} |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
