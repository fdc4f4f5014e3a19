"""Fitting scaling laws to measured (N, D, L) points.

Approach 3 as Epoch AI's replication of Chinchilla fits it (Besiroglu et al. 2024): minimise the Huber loss
(delta 1e-3) of log L against LSE(a - alpha log N, b - beta log D, e), where A = e^a, B = e^b, E = e^e, with
L-BFGS-B from a grid of starting points; confidence intervals by bootstrap (points resampled with
replacement, refitted). Approach 2: per compute budget a parabola in log N through the IsoFLOP curve, its
vertex N_opt(C), then least squares of log N_opt and log D_opt against log C.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from lmkit.errors import ConfigError
from lmkit.progress import progress_bar
from lmkit.scaling.laws import FLOPS_PER_TOKEN, ScalingLaw

HUBER_DELTA = 1e-3
# the objective is tiny (about delta |r| per point), so scipy's default tolerances stop short of the optimum
LBFGS_OPTIONS = {"ftol": 1e-12, "gtol": 1e-10, "maxiter": 1000}
# Hoffmann et al.'s grid of initialisations, which Epoch AI reuses: alpha, beta, e, a, b
START_GRID = (np.arange(0, 2.5, 0.5), np.arange(0, 2.5, 0.5), np.arange(-1, 1.5, 0.5), np.arange(0, 30, 5),
              np.arange(0, 30, 5))


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals r and its derivative."""
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    grad = np.where(small, r, delta * np.sign(r))
    return value, grad


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient, for one theta (5,) or a
    batch of them (K, 5) in the order (a, b, e, alpha, beta)."""
    theta = np.atleast_2d(theta)
    a, b, e, alpha, beta = (theta[:, i:i + 1] for i in range(5))
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (theta.shape[0], log_n.size))])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    pred = top + np.log(total)
    weights /= total  # softmax: d pred / d term
    value, dr = _huber(pred - log_l, delta)
    grad = np.stack([(dr * weights[0]).sum(1), (dr * weights[1]).sum(1), (dr * weights[2]).sum(1),
                     -(dr * weights[0] * log_n).sum(1), -(dr * weights[1] * log_d).sum(1)], axis=1)
    return value.sum(1), grad


def _as_law(theta: np.ndarray) -> ScalingLaw:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return ScalingLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


def _check_points(n_params, n_tokens, losses) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, l = (np.asarray(x, dtype=np.float64).ravel() for x in (n_params, n_tokens, losses))
    if not n.size == d.size == l.size:
        raise ConfigError("a scaling fit needs one N, D and loss per point")
    if n.size < 5:
        raise ConfigError(f"a five-parameter scaling law needs at least 5 points, got {n.size}; sweep more budgets "
                          "or shapes")
    if (n <= 0).any() or (d <= 0).any() or (l <= 0).any() or not np.isfinite(l).all():
        raise ConfigError("every point needs positive N and D and a positive finite loss")
    return np.log(n), np.log(d), np.log(l)


def _grid_starts(log_n, log_d, log_l, delta: float, count: int) -> np.ndarray:
    """The `count` points of START_GRID with the lowest objective, best first."""
    grid = np.array([(a, b, e, alpha, beta) for alpha, beta, e, a, b in itertools.product(*START_GRID)])
    values, _ = huber_objective(grid, log_n, log_d, log_l, delta)
    return grid[np.argsort(values, kind="stable")[:count]]


def _minimise(log_n, log_d, log_l, delta: float, starts: np.ndarray) -> np.ndarray:
    """L-BFGS-B from every start; the parameters of the lowest optimum."""
    from scipy.optimize import minimize

    def objective(theta):
        value, grad = huber_objective(theta, log_n, log_d, log_l, delta)
        return float(value[0]), grad[0]

    best = None
    for start in starts:
        result = minimize(objective, start, jac=True, method="L-BFGS-B", options=LBFGS_OPTIONS)
        if best is None or result.fun < best.fun:
            best = result
    return best.x


def fit_law(n_params, n_tokens, losses, delta: float = HUBER_DELTA, refine: int = 32) -> ScalingLaw:
    """The Approach-3 fit. The objective is evaluated at every start of the grid at once; L-BFGS-B runs from
    the `refine` best of them, and the lowest optimum wins."""
    log_n, log_d, log_l = _check_points(n_params, n_tokens, losses)
    return _as_law(_minimise(log_n, log_d, log_l, delta, _grid_starts(log_n, log_d, log_l, delta, refine)))


@dataclass
class LawFit:
    """An Approach-3 fit with bootstrap percentile intervals of each parameter and of the allocation exponents."""

    law: ScalingLaw
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    n_points: int = 0
    bootstrap: int = 0
    level: float = 0.95

    def to_dict(self) -> dict:
        a, b = self.law.exponents
        return {"approach": 3, **self.law.to_dict(), "a": a, "b": b, "n_points": self.n_points,
                "bootstrap": self.bootstrap, "level": self.level,
                "intervals": {k: list(v) for k, v in self.intervals.items()}}


def bootstrap_fit(n_params, n_tokens, losses, samples: int = 200, level: float = 0.95, seed: int = 0,
                  delta: float = HUBER_DELTA, refine: int = 32, progress: bool = False) -> LawFit:
    """fit_law on the points, and on `samples` resamples of them (with replacement), each started from that fit
    and the two best grid points, for (1 - level) / 2 and (1 + level) / 2 percentile intervals. progress: a bar
    over the resamples (stderr, a terminal only)."""
    log_n, log_d, log_l = _check_points(n_params, n_tokens, losses)
    grid = _grid_starts(log_n, log_d, log_l, delta, refine)
    theta = _minimise(log_n, log_d, log_l, delta, grid)
    law = _as_law(theta)
    starts = np.concatenate([theta[None], grid[:2]])
    rng = np.random.default_rng(seed)
    names = ("E", "A", "B", "alpha", "beta", "a", "b")
    draws = {k: [] for k in names}
    for _ in progress_bar(progress, iterable=range(samples), desc="bootstrap", unit="fit", dynamic_ncols=True):
        pick = rng.integers(0, log_n.size, log_n.size)
        if np.unique(pick).size < 5:
            continue
        refit = _as_law(_minimise(log_n[pick], log_d[pick], log_l[pick], delta, starts))
        for k, v in zip(names, (*(getattr(refit, k) for k in names[:5]), *refit.exponents)):
            draws[k].append(v)
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    intervals = {k: (float(np.percentile(v, lo)), float(np.percentile(v, hi))) for k, v in draws.items() if v}
    return LawFit(law, intervals, log_n.size, samples, level)


@dataclass
class IsoFlopFit:
    """Approach 2: the vertex of each budget's parabola and the power laws through them."""

    budgets: list[float]
    n_opt: list[float]
    d_opt: list[float]
    parabolas: list[tuple[float, float, float]]   # (c2, c1, c0) of L = c2 x^2 + c1 x + c0, x = ln N
    a: float                                        # N_opt ~ C^a
    b: float                                        # D_opt ~ C^b
    log_n_intercept: float
    log_d_intercept: float
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)

    def n_opt_at(self, compute: float) -> float:
        return math.exp(self.log_n_intercept + self.a * math.log(compute))

    def d_opt_at(self, compute: float) -> float:
        return math.exp(self.log_d_intercept + self.b * math.log(compute))

    def to_dict(self) -> dict:
        return {"approach": 2, "budgets": self.budgets, "n_opt": self.n_opt, "d_opt": self.d_opt,
                "parabolas": [list(p) for p in self.parabolas], "a": self.a, "b": self.b,
                "log_n_intercept": self.log_n_intercept, "log_d_intercept": self.log_d_intercept,
                "intervals": {k: list(v) for k, v in self.intervals.items()}}


def _isoflop_once(compute, n_params, losses, flops_per_token) -> IsoFlopFit:
    budgets, n_opt, d_opt, parabolas = [], [], [], []
    for c in sorted(set(compute)):
        on = compute == c
        if len(np.unique(n_params[on])) < 3:  # a parabola needs three distinct sizes (resamples repeat points)
            continue
        coeffs = np.polyfit(np.log(n_params[on]), losses[on], 2)
        if coeffs[0] <= 0:  # no minimum: the budget's shapes do not bracket its optimum
            continue
        vertex = math.exp(-coeffs[1] / (2 * coeffs[0]))
        budgets.append(float(c))
        n_opt.append(vertex)
        d_opt.append(c / (flops_per_token * vertex))
        parabolas.append(tuple(float(x) for x in coeffs))
    if len(budgets) < 2:
        raise ConfigError("Approach 2 needs at least two budgets with three or more shapes whose losses curve "
                          "upward on both sides of a minimum; widen the shapes around each budget's optimum")
    log_c = np.log(budgets)
    a, log_n0 = np.polyfit(log_c, np.log(n_opt), 1)
    b, log_d0 = np.polyfit(log_c, np.log(d_opt), 1)
    return IsoFlopFit(budgets, n_opt, d_opt, parabolas, float(a), float(b), float(log_n0), float(log_d0))


def isoflop_fit(compute, n_params, losses, flops_per_token: float = FLOPS_PER_TOKEN, samples: int = 200,
                level: float = 0.95, seed: int = 0) -> IsoFlopFit:
    """Approach 2 on points grouped by compute budget, with bootstrap intervals of a and b (points resampled
    within each budget)."""
    c, n, l = (np.asarray(x, dtype=np.float64).ravel() for x in (compute, n_params, losses))
    fit = _isoflop_once(c, n, l, flops_per_token)
    rng = np.random.default_rng(seed)
    draws = {"a": [], "b": []}
    groups = [np.flatnonzero(c == budget) for budget in sorted(set(c))]
    for _ in range(samples):
        pick = np.concatenate([g[rng.integers(0, g.size, g.size)] for g in groups])
        try:
            refit = _isoflop_once(c[pick], n[pick], l[pick], flops_per_token)
        except (ConfigError, np.linalg.LinAlgError):
            continue
        draws["a"].append(refit.a)
        draws["b"].append(refit.b)
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    fit.intervals = {k: (float(np.percentile(v, lo)), float(np.percentile(v, hi))) for k, v in draws.items() if v}
    return fit
