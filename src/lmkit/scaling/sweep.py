"""IsoFLOP sweeps: for each compute budget C, several model shapes, each trained on D = C / (k N) tokens.

Every point is an ordinary `lmkit train` run folder (resumable with --resume); the sweep writes one JSON
line per finished point to results.jsonl, so a killed sweep continues where it stopped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from lmkit.atomic import atomic_write_text
from lmkit.errors import ConfigError
from lmkit.scaling.laws import FLOPS_PER_TOKEN, isoflop_tokens

HEAD_DIM = 32  # the default preset's width per head; shapes keep it so that width and depth alone vary
PARAM_CONVENTIONS = ("non-embedding", "total")


@dataclass(frozen=True)
class Shape:
    """A model shape of the sweep: depth and width of the `default` preset, with grouped-query attention: the
    largest number of key/value heads that divides the heads and is at most half of them."""

    n_layers: int
    d_model: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'4x256' -> 4 layers of width 256."""
        try:
            layers, width = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ConfigError(f"a shape is LAYERSxWIDTH such as 4x256, got {text!r}") from None
        if layers < 1 or width < HEAD_DIM or width % HEAD_DIM:
            raise ConfigError(f"shape {text!r}: need at least one layer and a width that is a multiple of {HEAD_DIM}")
        return cls(layers, width)

    @property
    def name(self) -> str:
        return f"{self.n_layers}x{self.d_model}"

    def overrides(self) -> dict:
        heads = self.d_model // HEAD_DIM
        kv_heads = max(k for k in range(1, max(1, heads // 2) + 1) if heads % k == 0)
        return dict(n_layers=self.n_layers, d_model=self.d_model, n_heads=heads, n_kv_heads=kv_heads)


DEFAULT_SHAPES = tuple(Shape.parse(s) for s in ("2x32", "1x64", "2x64", "3x64", "2x96", "2x128", "3x128"))


def count_parameters(model: torch.nn.Module, convention: str = "non-embedding") -> int:
    """Distinct parameters; "non-embedding" leaves out token and position embedding tables (Kaplan et al.'s N;
    a tied output head is the token table, so it goes too), "total" counts everything (Chinchilla's N)."""
    if convention not in PARAM_CONVENTIONS:
        raise ConfigError(f"parameter convention must be one of {', '.join(PARAM_CONVENTIONS)}, got {convention!r}")
    params = {id(p): p for p in model.parameters()}
    if convention == "non-embedding":
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


def shape_parameters(shape: Shape, vocab_size: int, seq_len: int, convention: str = "non-embedding") -> int:
    from lmkit.config import get_preset
    from lmkit.models import build_model

    config = get_preset("default", vocab_size=vocab_size, max_seq_len=seq_len, **shape.overrides())
    with torch.device("meta"):
        model = build_model(config)
    return count_parameters(model, convention)


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


def run_sweep(out: str | Path, plans: list[SweepPlan], corpus: list[str], batch_size: int, seq_len: int,
              vocab_size: int, flops_per_token: float = FLOPS_PER_TOKEN, convention: str = "non-embedding",
              optimizer: str | None = None, lr: float | None = None, seed: int = 0, progress: bool = True,
              log: Callable[[str], None] = print) -> list[dict]:
    """Train every planned point not yet in out/results.jsonl (a point whose run folder has a checkpoint resumes
    it) and append its result; returns all rows."""
    from lmkit.train import TrainConfig
    from lmkit.train.checkpoint import checkpoints
    from lmkit.train.trainer import Trainer

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


def measured_flops_per_second(rows: list[dict]) -> float:
    """The median of k N D / seconds over a sweep's points: this machine's training throughput in model FLOPs."""
    rates = sorted(r["flops_per_token"] * r["n_params"] * r["n_tokens"] / r["seconds"] for r in rows
                   if r.get("seconds"))
    if not rates:
        raise ConfigError("the sweep results hold no timings; --time-budget needs a sweep run on this machine")
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else math.sqrt(rates[mid - 1] * rates[mid])
