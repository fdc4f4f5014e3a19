"""metrics.jsonl (one JSON object per logged step) and the loss-curve plot."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lmkit.atomic import atomic_save_file, atomic_write_text


class MetricsLog:
    """Appends one JSON line per logged step; `truncate(step)` drops lines past a resumed step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a killed run
        return rows

    def truncate(self, step: int) -> None:
        """Keep the lines of steps <= step (what a run resumed from checkpoint `step` has already logged)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def reset(self) -> None:
        atomic_write_text(self.path, "")

    def append(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


def plot_losses(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Training loss per logged step and validation loss per evaluation, as a PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    atomic_save_file(path, lambda tmp: fig.savefig(tmp, format="png"))
