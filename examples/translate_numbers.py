"""Train a small T5-style model (preset t5-tiny) to write numbers in English words, on the CPU.

    python examples/translate_numbers.py --out runs/numbers

The task (lmkit.data.translation) pairs "translate numbers to words: 40517" with
"forty thousand five hundred seventeen"; 20,000 training pairs, 500 held-out numbers never seen
in training. The run folder gets the model and tokenizer (a T5 folder transformers loads),
metrics.jsonl (loss, val_loss, BLEU, ROUGE, exact match), loss_curve.png and bleu_curve.png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/numbers")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a model this small)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from lmkit.data.translation import make_pairs, task_tokenizer
    from lmkit.train.translation import fit_pairs

    train, test = make_pairs(20000, 500, seed=args.seed)
    wall, cpu = time.perf_counter(), time.process_time()
    result = fit_pairs(train, test, task_tokenizer(), args.out, steps=args.steps, time_budget=args.time_budget,
                       batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
                       task="numbers")
    result.update(wall_s=round(time.perf_counter() - wall, 1), cpu_s=round(time.process_time() - cpu, 1))
    print(json.dumps(result, indent=1))
    _plot_bleu(Path(args.out))


def _plot_bleu(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(r["step"], r["bleu"]) for r in rows if "bleu" in r]
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(*zip(*points), "o-")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out corpus BLEU")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bleu_curve.png")


if __name__ == "__main__":
    main()
