"""Unstructured magnitude pruning (Han et al. 2015; Zhu and Gupta 2017): zero the weights of smallest |w|.

Prunable weights are the linear layers' matrices inside the blocks (embeddings, norms, biases and the output head
stay dense, as in Zhu and Gupta). Global scope ranks all of them together, so layers end at different sparsities;
layer scope prunes each matrix to the same fraction. Gradual pruning raises the sparsity along the cubic schedule
s_t = s_f + (s_i - s_f) (1 - (t - t_0) / (n dt))^3 while fine-tuning, re-applying the masks after every step.
The result is saved dense with zeros, which every reader loads; `sparse_speed` measures what torch.sparse gains.
"""
from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from lmkit.errors import ConfigError

SCOPES = ("global", "layer")


def prunable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The 2-D weights of the linear layers inside the model's blocks, by parameter name."""
    heads = {id(p) for name, m in model.named_modules() if name.endswith(("lm_head", "classifier", "score"))
             for p in m.parameters()}
    return {f"{name}.weight": m.weight for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) not in heads and ".layers." in f".{name}."}


def check_sparsity(sparsity: float, flag: str = "--unstructured") -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ConfigError(f"{flag} is the fraction of weights to zero, in [0, 1) (e.g. 0.5), got {sparsity!r}")


@torch.no_grad()
def magnitude_masks(model: nn.Module, sparsity: float, scope: str = "global") -> dict[str, torch.Tensor]:
    """Keep-masks that zero the `sparsity` fraction of prunable weights with the smallest |w| (ties: lower index
    first), over all of them ("global") or in each matrix ("layer")."""
    check_sparsity(sparsity)
    if scope not in SCOPES:
        raise ConfigError(f"unknown pruning scope {scope!r}; choose global or layer")
    weights = prunable(model)
    if not weights:
        raise ConfigError("the model has no linear layers inside its blocks to prune")
    if scope == "layer":
        return {name: _keep(w.abs().flatten(), round(sparsity * w.numel())).view_as(w) for name, w in weights.items()}
    flat = torch.cat([w.abs().flatten().float().cpu() for w in weights.values()])
    keep = _keep(flat, round(sparsity * flat.numel()))
    masks, start = {}, 0
    for name, w in weights.items():
        masks[name] = keep[start:start + w.numel()].view_as(w).to(w.device)
        start += w.numel()
    return masks


def _keep(magnitudes: torch.Tensor, n_zero: int) -> torch.Tensor:
    keep = torch.ones_like(magnitudes, dtype=torch.bool)
    if n_zero:
        keep[torch.sort(magnitudes, stable=True).indices[:n_zero]] = False
    return keep


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, keep in masks.items():
        params[name].mul_(keep.to(params[name].dtype))


def current_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """The masks a pruned model carries: its prunable weights that are not exactly zero."""
    return {name: w.detach() != 0 for name, w in prunable(model).items()}


def sparsity_report(model: nn.Module) -> dict:
    """Zero fraction of the prunable weights overall and per matrix."""
    weights = prunable(model)
    zeros = {name: int((w == 0).sum()) for name, w in weights.items()}
    total = sum(w.numel() for w in weights.values())
    return {"sparsity": sum(zeros.values()) / max(total, 1), "prunable_parameters": total,
            "per_layer": {name: zeros[name] / w.numel() for name, w in weights.items()}}


def cubic_sparsity(step: int, final: float, start: int, end: int, initial: float = 0.0) -> float:
    """Zhu and Gupta's schedule: s_i before `start`, s_f from `end` on, s_f + (s_i - s_f)(1 - p)^3 between."""
    if step <= start:
        return initial
    if step >= end:
        return final
    return final + (initial - final) * (1 - (step - start) / (end - start)) ** 3


@torch.no_grad()
def sparse_speed(weight: torch.Tensor, batch: int = 64, repeats: int = 20) -> dict:
    """Seconds for x W^T with W dense and as torch.sparse CSR (the same zeros), best of `repeats`, and the largest
    difference between the two products (they compute the same thing: a check that the timing is fair)."""
    x = torch.randn(batch, weight.shape[1], dtype=weight.dtype)
    with warnings.catch_warnings():  # torch calls its CSR support beta on every conversion
        warnings.simplefilter("ignore", UserWarning)
        csr = weight.to_sparse_csr()
    out = {}
    products = {"dense": lambda: x @ weight.T, "sparse_csr": lambda: (csr @ x.T).T}
    out["max_difference"] = float((products["dense"]() - products["sparse_csr"]()).abs().max())
    for name, fn in products.items():
        fn()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[name] = best
    return out


class GradualPruning:
    """Zhu and Gupta's gradual pruning inside a fine-tuning run: every `every` steps from `start` to `end` the masks
    are recomputed at the cubic schedule's sparsity; after each step they are re-applied. The masks are the zeros
    of the weights, so a resumed run recovers them from its checkpoint."""

    def __init__(self, final: float, start: int, end: int, every: int, scope: str = "global"):
        check_sparsity(final)
        if not 0 <= start <= end or every < 1:
            raise ConfigError(f"gradual pruning needs 0 <= start <= end and every >= 1, got {start}, {end}, {every}")
        self.final, self.start, self.end, self.every, self.scope = final, start, end, every, scope
        self.masks: dict[str, torch.Tensor] | None = None

    def before_step(self, model: nn.Module, step: int) -> None:
        if self.masks is None:
            self.masks = current_masks(model)
        due = step == self.end or (self.start <= step < self.end and (step - self.start) % self.every == 0)
        if due:
            self.masks = magnitude_masks(model, cubic_sparsity(step, self.final, self.start, self.end), self.scope)
            apply_masks(model, self.masks)

    def after_step(self, model: nn.Module) -> None:
        apply_masks(model, self.masks)
