"""Train the points of an IsoFLOP sweep (lmkit.scaling.sweep plans them): every point an ordinary `lmkit train`
run folder (resumable with --resume); one JSON line per finished point in results.jsonl, so a killed sweep
continues where it stopped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from lmkit.atomic import atomic_write_text
from lmkit.scaling.laws import FLOPS_PER_TOKEN
from lmkit.scaling.sweep import SweepPlan, read_results
from lmkit.train.checkpoint import checkpoints
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer


def run_sweep(out: str | Path, plans: list[SweepPlan], corpus: list[str], batch_size: int, seq_len: int,
              vocab_size: int, flops_per_token: float = FLOPS_PER_TOKEN, convention: str = "non-embedding",
              optimizer: str | None = None, lr: float | None = None, seed: int = 0, progress: bool = True,
              log: Callable[[str], None] = print) -> list[dict]:
    """Train every planned point not yet in out/results.jsonl (a point whose run folder has a checkpoint resumes
    it) and append its result; returns all rows."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    rows = read_results(results_path) if results_path.exists() else []
    done = {row["run"] for row in rows}
    for i, plan in enumerate(plans, 1):
        if plan.run_name in done:
            continue
        run_dir = out / plan.run_name
        cfg = TrainConfig(preset="default", corpus=list(corpus), out=str(run_dir), max_steps=plan.steps,
                          batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed,
                          optimizer=optimizer, lr=lr, progress=progress, resume=bool(checkpoints(run_dir)),
                          model_overrides=plan.shape.overrides())
        log(f"[{i}/{len(plans)}] C={plan.compute:.3g} shape {plan.shape.name}: N={plan.n_params:,}, "
            f"{plan.steps} steps")
        result = Trainer(cfg).fit()
        row = {"run": plan.run_name, "compute": plan.compute, "n_layers": plan.shape.n_layers,
               "d_model": plan.shape.d_model, "n_params": plan.n_params, "param_convention": convention,
               "n_tokens": plan.steps * batch_size * seq_len, "flops_per_token": flops_per_token,
               "steps": plan.steps, "val_loss": float(result["val_loss"]), "val_bpb": float(result["val_bpb"]),
               "seconds": float(result["elapsed"])}
        rows.append(row)
        atomic_write_text(results_path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows
