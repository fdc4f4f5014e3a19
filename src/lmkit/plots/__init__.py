"""Pictures of the math (matplotlib, Agg, PNG): positions, attention maps, embedding PCA, the logit lens.

Each picture's numbers come from a function that returns them (tested against the formula) and are
saved beside the PNG as JSON, so a reader can check the picture against its data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lmkit.atomic import atomic_save_file, atomic_write_json


def new_figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def save(fig, path: str | Path, data: dict[str, Any] | None = None) -> Path:
    """Write the figure as PNG at `path` and its numbers as JSON beside it (same name, .json)."""

    path = Path(path)
    fig.tight_layout()
    atomic_save_file(path, lambda tmp: fig.savefig(tmp, format="png"))
    if data is not None:
        atomic_write_json(path.with_suffix(".json"), data, indent=None)
    return path
