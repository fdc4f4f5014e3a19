"""Kaplan et al. 2020's single-variable laws L(N) = (N_c / N)^alpha_N and L(D) = (D_c / D)^alpha_D.

Kaplan fit each law where the other variable does not limit the loss (models trained to convergence for L(N),
large models stopped early for L(D)). A sweep of fixed budgets has no such points, so each law is fitted to the
sweep's frontier in that variable: the points no smaller point beats (the lowest loss reached with at most N
parameters, or at most D tokens). On the frontier log L = alpha (log N_c - log N): a least-squares line in log-log.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lmkit.errors import ConfigError

KAPLAN_PUBLISHED = {"alpha_N": 0.076, "N_c": 8.8e13, "alpha_D": 0.095, "D_c": 5.4e13}  # Kaplan et al. 2020, eq. 1.1-1.2


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = (x_c / x)^alpha, fitted on `points` frontier points."""
    alpha: float
    x_c: float
    points: int

    def loss(self, x: float) -> float:
        return (self.x_c / x) ** self.alpha


def frontier(x, losses) -> tuple[np.ndarray, np.ndarray]:
    """The points whose loss is below that of every point with a smaller or equal x, sorted by x."""
    order = np.argsort(np.asarray(x, dtype=np.float64), kind="stable")
    xs, ls = np.asarray(x, dtype=np.float64)[order], np.asarray(losses, dtype=np.float64)[order]
    keep, best = [], math.inf
    for i, (xi, li) in enumerate(zip(xs, ls)):
        if i + 1 < len(xs) and xs[i + 1] == xi:  # of equal x, only the lowest loss can be on the frontier
            ls[i + 1] = min(ls[i + 1], li)
            continue
        if li < best:
            keep.append(i)
            best = li
    return xs[keep], ls[keep]


def fit_power_law(x, losses, name: str) -> PowerLaw:
    """Least squares of log L against log x on the frontier: log L = alpha log x_c - alpha log x."""
    x, losses = np.asarray(x, dtype=np.float64).ravel(), np.asarray(losses, dtype=np.float64).ravel()
    if x.size != losses.size or (x <= 0).any() or (losses <= 0).any() or not np.isfinite(losses).all():
        raise ConfigError(f"fitting L({name}) needs one positive {name} and one positive finite loss per point")
    fx, fl = frontier(x, losses)
    if fx.size < 2:
        raise ConfigError(f"fitting L({name}) needs at least two points where a larger {name} lowers the loss; "
                          f"sweep more sizes")
    slope, intercept = np.polyfit(np.log(fx), np.log(fl), 1)
    alpha = -float(slope)  # positive: the frontier's loss falls with x by construction
    return PowerLaw(alpha=alpha, x_c=float(math.exp(intercept / alpha)), points=int(fx.size))


def kaplan_fit(n_params, n_tokens, losses) -> dict[str, PowerLaw]:
    """{"N": L(N), "D": L(D)} of a sweep's points."""
    return {"N": fit_power_law(n_params, losses, "N"), "D": fit_power_law(n_tokens, losses, "D")}
