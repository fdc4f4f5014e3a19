"""Pictures of a sweep: IsoFLOP curves with each budget's parabola and the fitted frontier; loss against N
and against D."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lmkit.scaling.fit import IsoFlopFit
from lmkit.scaling.laws import ScalingLaw


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_isoflops(rows: list[dict], path: str | Path, isoflop: IsoFlopFit | None = None,
                  law: ScalingLaw | None = None) -> None:
    """Loss against N (log axis) per budget: the points, Approach 2's parabolas and vertices, and Approach 3's
    law along each IsoFLOP line."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({r["compute"] for r in rows})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
    for c, colour in zip(budgets, colours):
        on = [r for r in rows if r["compute"] == c]
        n = np.array([r["n_params"] for r in on], dtype=float)
        ax.scatter(n, [r["val_loss"] for r in on], color=colour, label=f"C = {c:.2g}", zorder=3)
        grid = np.geomspace(n.min() / 1.5, n.max() * 1.5, 100)
        k = on[0]["flops_per_token"]
        if law is not None:
            ax.plot(grid, [law.loss(x, c / (k * x)) for x in grid], color=colour, linestyle=":", linewidth=1)
        if isoflop is not None and c in isoflop.budgets:
            c2, c1, c0 = isoflop.parabolas[isoflop.budgets.index(c)]
            x = np.log(grid)
            ax.plot(grid, c2 * x * x + c1 * x + c0, color=colour, linewidth=1)
    if isoflop is not None:
        vertex_loss = [np.polyval(p, np.log(n)) for p, n in zip(isoflop.parabolas, isoflop.n_opt)]
        ax.plot(isoflop.n_opt, vertex_loss, "k--", marker="*", markersize=9, label="N_opt(C) (Approach 2)")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("IsoFLOP curves" + (" (dotted: Approach 3 fit)" if law is not None else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_vs(rows: list[dict], path: str | Path, law: ScalingLaw | None = None) -> None:
    """Two panels: loss against N and against D, coloured by budget, with the law's prediction at each point."""
    plt = _figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    losses = np.array([r["val_loss"] for r in rows])
    for ax, key, label in zip(axes, ("n_params", "n_tokens"), ("parameters N", "tokens D")):
        x = np.array([r[key] for r in rows], dtype=float)
        ax.scatter(x, losses, c=np.log([r["compute"] for r in rows]), cmap="viridis", label="measured")
        if law is not None:
            predicted = [law.loss(r["n_params"], r["n_tokens"]) for r in rows]
            ax.scatter(x, predicted, marker="x", color="red", label="fit")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.legend(fontsize=8)
    _save(plt, fig, path)


def _save(plt, fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kaplan(rows: list[dict], laws: dict, path: str | Path) -> None:
    """Loss against N and against D (log-log), each frontier marked, with the fitted (N_c / N)^alpha_N and
    (D_c / D)^alpha_D lines."""
    from lmkit.scaling.kaplan import frontier

    plt = _figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    losses = np.array([r["val_loss"] for r in rows])
    for ax, key, var, label in zip(axes, ("n_params", "n_tokens"), ("N", "D"), ("parameters N", "tokens D")):
        x = np.array([r[key] for r in rows], dtype=float)
        law = laws[var]
        fx, fl = frontier(x, losses)
        ax.scatter(x, losses, color="0.7", label="sweep points")
        ax.scatter(fx, fl, color="C0", label="frontier (fitted)")
        grid = np.geomspace(x.min() / 1.5, x.max() * 1.5, 50)
        ax.plot(grid, [law.loss(g) for g in grid], "C3",
                label=f"L({var}) = ({var}_c / {var})^{law.alpha:.3f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
        ax.yaxis.set_major_formatter(plt.ScalarFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.legend(fontsize=8)
    _save(plt, fig, path)
