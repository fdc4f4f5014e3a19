"""AdamW with decay and no-decay groups (or Muon for the hidden matrices: train/muon.py), and the learning-rate
schedule.

Weight decay applies to the weight matrices of linear layers only; biases, norm gains and
embedding tables (with the LM head tied to them) are left undecayed.
Schedule: lr(s) = lr_max (s + 1) / W for s < W (linear warm-up), then cosine decay
lr(s) = lr_min + (lr_max - lr_min) (1 + cos(pi (s - W) / (S - W))) / 2 up to step S, or linear decay
lr(s) = lr_min + (lr_max - lr_min) (S - s) / (S - W), or constant lr_max (`learning_rate`, --lr-schedule).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lmkit.train.muon import MuonAdamW
from lmkit.train.param_groups import param_groups

__all__ = ["OPTIMIZERS", "SCHEDULES", "build_optimizer", "learning_rate", "lr_at", "param_groups", "set_lr"]


OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("linear", "cosine", "constant")


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW over `param_groups`, or (kind "muon") Muon for the hidden matrices and AdamW for the rest (train/muon.py)."""
    if kind == "muon":
        return MuonAdamW(model, lr, weight_decay, betas, eps)
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def lr_at(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return max_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(schedule: str, step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr: float = 0.0) -> float:
    """Learning rate of step `step` (0-based) under --lr-schedule `schedule`, after the same linear warm-up."""
    if schedule == "cosine":
        return lr_at(step, max_lr, warmup_steps, total_steps, min_lr)
    if step < warmup_steps:
        return max_lr * ((step + 1) / warmup_steps)
    if schedule == "constant" or total_steps <= warmup_steps:
        return max_lr
    return min_lr + (max_lr - min_lr) * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
