"""IsoFLOP sweeps: for each compute budget C, several model shapes, each trained on D = C / (k N) tokens.

This module plans the points and reads their results; lmkit.train.sweep trains them (every point an ordinary
`lmkit train` run folder, resumable with --resume, one JSON line per finished point in results.jsonl).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from lmkit.errors import ConfigError
from lmkit.scaling.laws import FLOPS_PER_TOKEN, isoflop_tokens
from lmkit.scaling.shapes import Shape, shape_parameters

@dataclass
class SweepPlan:
    """One row per point: budget, shape, its N and the steps that spend the budget."""

    compute: float
    shape: Shape
    n_params: int
    steps: int

    @property
    def run_name(self) -> str:
        return f"C{self.compute:.3g}-{self.shape.name}".replace("+", "")


def plan_sweep(budgets: Iterable[float], shapes: Iterable[Shape], batch_size: int, seq_len: int, vocab_size: int,
               flops_per_token: float = FLOPS_PER_TOKEN, convention: str = "non-embedding", min_steps: int = 20,
               max_tokens_per_param: float = 100.0, min_tokens_per_param: float = 1.0) -> list[SweepPlan]:
    """Every (budget, shape) whose token count D = C / (k N) is between min and max tokens per parameter (1 and 100 by default) and
    at least min_steps optimizer steps: shapes far from a budget's optimum teach the fit little."""
    plans = []
    tokens_per_step = batch_size * seq_len
    for c in budgets:
        if not c > 0:
            raise ConfigError(f"compute budgets must be positive FLOPs, got {c}")
        for shape in shapes:
            n = shape_parameters(shape, vocab_size, seq_len, convention)
            d = isoflop_tokens(c, n, flops_per_token)
            steps = round(d / tokens_per_step)
            if steps >= min_steps and min_tokens_per_param <= d / n <= max_tokens_per_param:
                plans.append(SweepPlan(float(c), shape, n, steps))
    if not plans:
        raise ConfigError("no shape fits these budgets (each point needs enough steps and 1-100 tokens per "
                          "parameter); give larger budgets or smaller shapes")
    return plans


def read_results(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.jsonl"
    if not path.is_file():
        raise ConfigError(f"no sweep results at {path}; run `lmkit scaling sweep --out DIR` first")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return rows


def measured_flops_per_second(rows: list[dict]) -> float:
    """The median of k N D / seconds over a sweep's points: this machine's training throughput in model FLOPs."""
    rates = sorted(r["flops_per_token"] * r["n_params"] * r["n_tokens"] / r["seconds"] for r in rows
                   if r.get("seconds"))
    if not rates:
        raise ConfigError("the sweep results hold no timings; --time-budget needs a sweep run on this machine")
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else math.sqrt(rates[mid - 1] * rates[mid])
