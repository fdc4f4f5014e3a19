"""What a training job plugs into the one loop (train/loop.py): its data, its loss, what it saves.

A job is the model, an optimizer over its trainable parameters, the micro-batches of optimizer step s on a rank,
and an objective:

    objective.count(batch) -> how many targets the batch scores (the step's loss divides by all of them)
    objective.loss(model, batch) -> (LossSum(sum, count), the model's load-balancing aux loss or None)

Everything else has a default here: no evaluation, no state beyond the RNGs, nothing written but metrics.jsonl
and the checkpoints. A new stage (reward model, DPO, ...) is a `Job` subclass with those few methods;
docs/architecture.md has a worked example.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lmkit.objectives import LossSum


class Objective(Protocol):
    """The loss of a job: a sum over the batch's targets and their number (see lmkit.objectives)."""

    def count(self, batch: Any) -> int: ...

    def loss(self, model: nn.Module, batch: Any) -> tuple[LossSum, torch.Tensor | None]: ...


class Job:
    """Defaults of every hook the loop calls; subclasses set `model`, `objective`, `seed` and give
    `build_optimizer`, `micro_batches` and `warmup`."""

    model: nn.Module
    objective: Objective
    seed: int = 0
    written_files: tuple[str, ...] = ()        # files the job writes into --out (removed if a new run fails early)
    temporary_prefixes: tuple[str, ...] = (".model.",)

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[Any]:
        """This rank's micro-batches of optimizer step `step` (a function of the seed, the step and the job's state)."""
        raise NotImplementedError

    def train_step(self, step: int) -> float:
        """Optimizer step `step` of the loop running this job (`loop` is set by it); its mean loss."""
        return self.loop.train_step(step)

    def warmup(self, total_steps: int | None) -> int:
        """Warm-up steps of a run of `total_steps` (None while a time budget is being planned)."""
        return 0

    def evaluate(self, precision: str) -> dict[str, float] | None:
        """Held-out scores (every rank calls it; at least "loss"), or None when the job has no held-out data."""
        return None

    def state(self) -> dict[str, Any]:
        """JSON the checkpoint keeps for an exact resume (e.g. the position in a shuffled epoch)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass

    def checkpoint_info(self) -> dict[str, Any]:
        """Other JSON the checkpoint records (the settings of the run)."""
        return {}

    def start(self, out: Path) -> None:
        """Rank 0, before the first step: files the run writes up front."""

    def step_row(self, loop, seconds: float, result: dict[str, float] | None) -> dict[str, Any]:
        """Fields metrics.jsonl gets beside step, loss, lr and grad_norm."""
        row: dict[str, Any] = {"tokens": loop.tokens_seen}
        if result is not None:
            row.update({f"val_{k}": v for k, v in result.items()})
        return row

    def logged(self, loop, row: dict[str, Any]) -> None:
        """Rank 0, after each row written to metrics.jsonl."""

    def postfix(self, row: dict[str, Any], result: dict[str, float] | None) -> dict[str, str]:
        return {"loss": f"{row['loss']:.3f}"}

    def report_line(self, loop, row: dict[str, Any], result: dict[str, float]) -> str:
        return f"step {loop.step}/{loop.total_steps or '?'}: loss {row['loss']:.4f}, val_loss {result['loss']:.4f}"

    def save(self, loop, gathered: dict[str, torch.Tensor] | None, final: bool) -> None:
        """After each checkpoint (`gathered`: the full weights of a sharded model on rank 0)."""

    def finish(self, loop) -> Any:
        """After the last step (every rank): the job's outputs and its result."""
        return {"step": loop.step, "elapsed": loop.elapsed}
