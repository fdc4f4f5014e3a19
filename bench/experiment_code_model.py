"""A small code model trained here, end to end: fill-in-the-middle pre-training on pycode, with and without the
`pycode_functions` task's 40 exemplar functions (its `train` split, the few-shot exemplars) mixed into the rows, then

- left-to-right bits per byte on held-out pycode (the run's validation split);
- infilling exact match on held-out pycode lines (experiment_fim's cases: a line of a held-out document cut out);
- function infilling on the 124 scored problems, none of them trained on: the model fills the body between the
  problem's signature and docstring (prefix) and the end of the function (suffix "\\n"), greedily; exact match
  against the reference body and the pass rate of the filled function in lmkit's sandbox;
- `lmkit harness --tasks pycode_functions,pycode_functions_10`: pass@1 (greedy, 3 exemplars) and pass@1/pass@10
  from 10 samples at temperature 0.8.

    python bench/experiment_code_model.py [--steps 600] [--mixes 0,0.1] [--out /tmp/code-model] [--cases 100]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import machine  # bench/machine.py (the script's folder is on sys.path)
from experiment_fim import cases, infill_exact_match

import lmkit
from lmkit.code.evaluate import evaluate_samples
from lmkit.data.fim import infill_bos, infill_prompt
from lmkit.evaluate.harness_run import run as harness_run
from lmkit.evaluate.harness_tasks.code_tasks import pycode_functions
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer

SHAPE = dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, dropout=0.0, attention_dropout=0.0, max_seq_len=256)


def exemplars_file(folder: Path) -> Path:
    """The task's train split (its few-shot exemplars) as a JSONL corpus, one function a document."""
    path = folder / "pycode_functions_train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = pycode_functions()["train"]
    path.write_text("".join(json.dumps({"text": r["prompt"] + r["canonical_solution"]}) + "\n" for r in rows))
    return path


def train(mix: float, steps: int, out: Path, exemplars: Path) -> dict:
    corpus = ["pycode"] if mix == 0 else [f"pycode:{1 - mix}", f"{exemplars}:{mix}"]
    cfg = TrainConfig(preset="tiny", objective="fim", corpus=corpus, out=str(out), max_steps=steps, batch_size=8,
                      seq_len=256, lr=3e-3, warmup_steps=steps // 10, vocab_size=1024, precision="fp32", seed=0,
                      save_every=steps, progress=False, model_overrides=SHAPE, fim_rate=0.5, fim_spm_rate=0.5)
    start = time.process_time()
    result = Trainer(cfg).fit()
    return {"mix": mix, "steps": steps, "val_bpb": round(result["val_bpb"], 4),
            "train_cpu_seconds": round(time.process_time() - start)}


@torch.no_grad()
def function_infilling(folder: Path) -> dict:
    """Fill each scored problem's body between its prompt and "\\n"; exact match and sandboxed pass rate."""
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    problems = {r["task_id"]: r for r in pycode_functions()["test"]}
    rows, exact = [], 0
    for task, problem in problems.items():
        ids = infill_prompt(tok, problem["prompt"], "\n", infill_bos(tok, model.config.bos_token_id))
        out = model.generate(torch.tensor([ids]), max_new_tokens=32)[0, len(ids):].tolist()
        middle = tok.decode(out, skip_special_tokens=True).split("\n")[0]
        exact += middle.strip() == problem["canonical_solution"].strip()
        rows.append({"task_id": task, "completion": middle + "\n"})
    results = evaluate_samples(rows, problems, timeout=3.0)
    return {"function_infill_exact": round(exact / len(rows), 4),
            "function_infill_pass": round(sum(r.passed for r in results) / len(rows), 4)}


def harness(folder: Path, limit: int | None) -> dict:
    results = harness_run(str(folder), ["pycode_functions", "pycode_functions_10"], batch_size=16,
                          limit=limit)["results"]
    return {"pass@1 greedy": results["pycode_functions"]["pass@1,sandbox"],
            "pass@1 (n=10, T=0.8)": results["pycode_functions_10"]["pass@1,sandbox"],
            "pass@10 (n=10, T=0.8)": results["pycode_functions_10"]["pass@10,sandbox"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--out", default="/tmp/code-model")
    ap.add_argument("--limit", type=int, default=None, help="harness problems per task (default: all 124)")
    ap.add_argument("--mixes", default="0,0.1", help="shares of rows from the exemplar functions (default 0,0.1)")
    args = ap.parse_args()
    torch.manual_seed(0)
    exemplars = exemplars_file(Path(args.out))
    tests = cases(args.cases)
    rows = []
    for mix in (float(m) for m in args.mixes.split(",")):
        out = Path(args.out) / f"mix-{mix}"
        row = train(mix, args.steps, out, exemplars)
        row["pycode_infill_exact"] = infill_exact_match(out, tests)
        row.update(function_infilling(out))
        row.update(harness(out, args.limit))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": machine.cpu_name(), "shape": SHAPE, "rows": rows}))


if __name__ == "__main__":
    main()
