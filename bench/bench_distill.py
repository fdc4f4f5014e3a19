"""Distillation (DistilBERT recipe) of the 4-layer base model into 2 layers, against the same 2-layer
student trained without the teacher (from the same every-other-layer init, and from scratch).

Prints a markdown table on the validation split of pydocs.   python bench/bench_distill.py [--steps N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

import lmkit  # noqa: E402
from lmkit.compress import DistillWeights, distill_causal_lm, student_from_teacher  # noqa: E402
from lmkit.finetune.clm import train_causal_lm  # noqa: E402


RUNS = {
    "distill": "student, distilled (alpha 2, beta 5, gamma 1, T 2)",
    "init": "student, every-other-layer init, labels only",
    "scratch": "student, random init, labels only",
    "teacher": "teacher (4 layers), trained the same extra steps (reference)",
}


def run(kind: str, teacher, data, steps: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    student = student_from_teacher(teacher) if kind != "teacher" else type(teacher)(teacher.config)
    if kind == "teacher":
        student.load_state_dict(teacher.state_dict())
    if kind == "scratch":
        student = type(teacher)(student.config)  # fresh random weights, same shape
    t = time.perf_counter()
    if kind == "distill":
        distill_causal_lm(teacher, student, data.stream, data.pad, steps, batch_size, lr=1e-3, warmup_steps=10,
                          weights=DistillWeights())
    else:
        train_causal_lm(student, data.stream, data.pad, steps, batch_size, lr=3e-3 if kind == "scratch" else 1e-3,
                        warmup_steps=10, weight_decay=0.1)
    r = data.evaluate(student)
    return dict(model=RUNS[kind], params=student.num_parameters(), **r, time=f"{time.perf_counter() - t:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                    help="which students to train (results are kept, so runs may go in separate processes)")
    args = ap.parse_args()
    folder = setup.base_model()
    data = setup.data(folder, "pydocs")
    teacher = lmkit.load_model(folder)
    results = setup.BENCH_DIR / f"distill-{folder.name}-{args.steps}x{args.batch_size}"
    results.mkdir(parents=True, exist_ok=True)
    for kind in args.runs:
        (results / f"{kind}.json").write_text(json.dumps(run(kind, teacher, data, args.steps, args.batch_size)))
    rt = data.evaluate(teacher)
    rows = [dict(model=f"teacher ({teacher.config.n_layers} layers)", params=teacher.num_parameters(), **rt, time="-")]
    rows += [json.loads((results / f"{k}.json").read_text()) for k in RUNS if (results / f"{k}.json").exists()]
    for r in rows:
        r["keep"] = f"{100 * r['accuracy'] / rt['accuracy']:.1f}%"
        r["params"] = f"{r['params']:,}"
        r["loss"], r["ppl"], r["acc"] = f"{r['loss']:.3f}", f"{r['perplexity']:.1f}", f"{r['accuracy']:.3f}"
    print(f"\n{args.steps} steps x batch {args.batch_size} x {setup.SEQ_LEN} tokens of pydocs for each student\n")
    print(machine.describe(["fp32"]))
    print(setup.table(rows, [("model", "model"), ("params", "parameters"), ("loss", "val loss"), ("ppl", "perplexity"),
                             ("acc", "next-token acc."), ("keep", "acc. vs teacher"), ("time", "train time")]))


if __name__ == "__main__":
    main()
