"""Remedies for catastrophic forgetting: a pull toward the pre-trained weights w0 while fine-tuning.

L2-SP (Li et al. 2018): Omega(w) = lambda/2 * sum_i (w_i - w0_i)^2.
EWC (Kirkpatrick et al. 2017): Omega(w) = lambda/2 * sum_i F_i (w_i - w0_i)^2, F the diagonal of the (empirical)
Fisher information of the pre-training objective at w0: the mean over sequences of the squared gradient of each
sequence's mean next-token loss, here on the pre-training corpus.
The penalty's gradient lambda * F_i * (w_i - w0_i) is added to each gradient just before the optimizer steps, so
the logged loss stays the task's own. Only weights that exist in w0 are pulled (a new task head is free).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.errors import ConfigError

KINDS = ("l2sp", "ewc")


def parse_regularize(spec: str | None) -> tuple[str, float] | None:
    """'l2sp:0.01' -> ("l2sp", 0.01); None stays None."""
    if spec is None:
        return None
    kind, _, value = str(spec).partition(":")
    try:
        lam = float(value)
    except ValueError:
        lam = float("nan")
    if kind not in KINDS or not lam > 0 or lam == float("inf"):
        raise ConfigError(f"--regularize takes l2sp:LAMBDA or ewc:LAMBDA with LAMBDA > 0 (e.g. l2sp:0.01), got {spec!r}")
    return kind, lam


class Anchor:
    """The pull toward w0 of the trainable weights present at construction (see the module docstring)."""

    def __init__(self, model: nn.Module, lam: float, fisher: dict[str, torch.Tensor] | None = None):
        self.lam = lam
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.start = {n: p.detach().clone() for n, p in self.params.items()}
        self.fisher = fisher  # None: L2-SP (F = 1)

    def _weight(self, name: str):
        return 1.0 if self.fisher is None else self.fisher.get(name, 0.0)

    @torch.no_grad()
    def add_gradients(self) -> None:
        """grad += lambda * F * (w - w0)."""
        for name, p in self.params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(self.lam * self._weight(name) * (p - self.start[name]))

    @torch.no_grad()
    def penalty(self) -> float:
        """lambda/2 * sum F (w - w0)^2."""
        return 0.5 * self.lam * sum(float((self._weight(n) * (p - self.start[n]) ** 2).sum())
                                    for n, p in self.params.items())

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Add the penalty's gradient inside every optimizer step, before the update."""
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.add_gradients())


def fisher_diagonal(model: nn.Module, rows: torch.Tensor, loss_fn) -> dict[str, torch.Tensor]:
    """Mean over the rows of the squared gradient of loss_fn(model, row[None]) for each trainable parameter."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    was_training = model.training
    model.eval()  # no dropout: the Fisher of the model as it predicts
    for row in rows:
        model.zero_grad(set_to_none=True)
        loss_fn(model, row[None]).backward()
        for n, p in params.items():
            if p.grad is not None:
                total[n] += p.grad.detach() ** 2
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return {n: t / len(rows) for n, t in total.items()}


def build_anchor(model: nn.Module, spec: str | None, rows=None, loss_fn=None) -> Anchor | None:
    """The Anchor `--regularize` asks for; EWC estimates its Fisher on `rows` (pre-training text) with `loss_fn`."""
    parsed = parse_regularize(spec)
    if parsed is None:
        return None
    kind, lam = parsed
    if kind == "l2sp":
        return Anchor(model, lam)
    if rows is None or loss_fn is None:
        raise ConfigError("--regularize ewc needs pre-training text for its Fisher; this task has none, use l2sp")
    return Anchor(model, lam, fisher_diagonal(model, rows, loss_fn))
