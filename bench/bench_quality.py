"""Quality per compute, side by side: lmkit's default recipe against what a user would train instead, in the
same wall-clock budget on the same machine, the same `pydocs` split and the same BPE tokenizer, both scored by
`lmkit eval`'s bits per byte on the validation split.

lmkit runs three ways: its default recipe, whose shape `lmkit train --time-budget` sizes for the budget from the
pydocs scaling law and the speed it measures (train/sizing.py); the same recipe on the 4x256 preset as it is
(`--sizing off`); and `--optimizer adamw`. The baseline is a GPT-2 of the 4x256 preset's size built with `transformers` and trained with torch's AdamW on
nanoGPT's recipe (peak lr 1e-3 after a linear warm-up, cosine to a tenth, weight decay 0.1 on matrices,
betas 0.9/0.95, gradient clipping 1.0, the same dropout), fed the very rows lmkit's trainer reads (its
`PackedStream`, same seed), in the precision lmkit would choose on this CPU (bf16 autocast only where native).

    python bench/bench_quality.py [--budget 300] [--out runs/quality] [--runs default preset adamw]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402

CALIBRATION_STEPS = 8
# lmkit's runs: (table row, `lmkit train` flags besides --time-budget and --out)
RUNS = {
    "default": ("lmkit default recipe (shape sized for the budget)", []),
    "preset": ("lmkit default recipe, the 4x256 preset as it is", ["--sizing", "off"]),
    "adamw": ("lmkit --optimizer adamw (sized)", ["--optimizer", "adamw"]),
}
BASELINE = "GPT-2 (transformers), nanoGPT recipe"


def lmkit_eval_bpb(folder: Path) -> float:
    """Bits per byte of `lmkit eval` on the folder's training corpus' validation split."""
    done = subprocess.run([sys.executable, "-m", "lmkit", "eval", "--model", str(folder), "--corpus", "pydocs"],
                          capture_output=True, text=True, check=True)
    match = re.search(r"bits per byte\s+([0-9.]+)", done.stdout)
    if not match:
        raise SystemExit(f"could not read bits per byte from lmkit eval:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1))


def train_lmkit(out: Path, budget: float, extra: list[str]) -> dict:
    subprocess.run([sys.executable, "-m", "lmkit", "train", "--time-budget", str(budget), "--out", str(out), *extra],
                   check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    shape = f"{config['num_hidden_layers']}x{config['hidden_size']}"
    return {"steps": rows[-1]["step"], "bpb": lmkit_eval_bpb(out), "shape": shape}


def lr_at(step: int, total: int, warmup: int, peak: float = 1e-3, floor: float = 1e-4) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def train_baseline(out: Path, budget: float, batch_size: int, seq_len: int) -> dict:
    """A transformers GPT-2 on nanoGPT's recipe, on the rows lmkit's trainer would read."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lmkit.config import PRESETS
    from lmkit.train import TrainConfig
    from lmkit.train.trainer import Trainer

    data = Trainer(TrainConfig(out=str(out), batch_size=batch_size, seq_len=seq_len, time_budget=budget,
                               progress=False, sizing="off"))
    preset = PRESETS["default"]
    config = GPT2Config(vocab_size=data.model_config.vocab_size, n_positions=seq_len, n_embd=preset["d_model"],
                        n_layer=preset["n_layers"], n_head=preset["n_heads"], resid_pdrop=preset["dropout"],
                        embd_pdrop=preset["dropout"], attn_pdrop=preset["dropout"],
                        bos_token_id=data.bos_id, eos_token_id=data.bos_id)
    model = GPT2LMHeadModel(config).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    precision = data.cfg.precision
    total, warmup, step, start = None, 50, 0, time.perf_counter()
    while total is None or step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total or 10**9, warmup)
        rows = data.stream.rows(data.cfg.seed, step, batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if total is None and step == CALIBRATION_STEPS:  # the same plan lmkit's --time-budget makes
            total = max(step, int(budget / ((time.perf_counter() - start) / step)))
            warmup = min(warmup, total // 10)
    model.eval().save_pretrained(out)
    data.tokenizer.save_pretrained(out)
    return {"steps": step, "bpb": lmkit_eval_bpb(out), "shape": f"{config.n_layer}x{config.n_embd}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds of training for each (default 300)")
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--runs", nargs="*", choices=list(RUNS), default=list(RUNS),
                    help="which lmkit runs (default all; none: the baseline alone, which always runs)")
    args = ap.parse_args()
    out = Path(args.out)
    precision = "bf16" if machine.bf16_native() else "fp32"
    print(machine.describe([precision]))
    rows = {RUNS[key][0]: train_lmkit(out / f"lmkit-{key}", args.budget, RUNS[key][1]) for key in args.runs}
    rows[BASELINE] = train_baseline(out / "baseline", args.budget, args.batch_size, args.seq_len)
    base = rows[BASELINE]["bpb"]
    print(f"\n{args.budget:g} s each, pydocs validation split, lmkit eval bits per byte ({precision})")
    print(f"| run | shape | steps | bits per byte | vs baseline |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['shape']} | {r['steps']} | {r['bpb']:.3f} | {r['bpb'] - base:+.3f} |")


if __name__ == "__main__":
    main()
