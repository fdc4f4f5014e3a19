"""Pictures of the math (matplotlib, Agg, PNG): positions, attention maps, embedding PCA, the logit lens.

Each picture's numbers come from a function that returns them (tested against the formula) and are
saved beside the PNG as JSON, so a reader can check the picture against its data. The PNG itself carries
its title and, per panel, the axis labels and whether it is a colour bar (`figure_summary`), as PNG text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lmkit.atomic import atomic_save_file, atomic_write_json

# spaces, line breaks and tabs of a token, drawn so that they can be seen
_VISIBLE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}
SUMMARY_KEY = "lmkit:figure"  # the PNG text chunk holding figure_summary as JSON


def token_label(token: str) -> str:
    """A token as a label: spaces as ␣, line breaks as ↵, tabs as ⇥, other control characters escaped, the
    empty string as ∅, so that " the" and "the" read differently."""
    if not token:
        return "\u2205"
    return "".join(_VISIBLE.get(ch) or (ch if ch.isprintable() else repr(ch)[1:-1]) for ch in token)


def quoted(text: str, limit: int = 60) -> str:
    """Text for a title: on one line, cut at `limit` characters with an ellipsis, in quotes."""
    line = " ".join(text.split())
    return "\u201c" + (line if len(line) <= limit else line[:limit - 1].rstrip() + "\u2026") + "\u201d"


def model_name(folder: str | Path) -> str:
    """A model folder's name for titles: the path as given when it is relative and short (runs/demo/sft),
    else the folder's own name."""
    path = Path(folder)
    if not path.is_absolute() and ".." not in path.parts and len(path.as_posix()) <= 40:
        return path.as_posix()
    return path.resolve().name


def figure_summary(fig) -> dict[str, Any]:
    """{"title": the figure's title (its suptitle, else its first panel's), "panels": [{"title", "xlabel",
    "ylabel", "colorbar", "xticklabels", "yticklabels"}]}: what a reader looks for first, kept in the PNG."""
    panels = [{"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
               "colorbar": hasattr(ax, "_colorbar"), "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
               "yticklabels": [t.get_text() for t in ax.get_yticklabels()]} for ax in fig.axes]
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    return {"title": title or next((p["title"] for p in panels if p["title"]), ""), "panels": panels}


def read_summary(path: str | Path) -> dict[str, Any]:
    """figure_summary of a PNG written by `save`."""
    import json

    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[SUMMARY_KEY])


def new_figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def save(fig, path: str | Path, data: dict[str, Any] | None = None, layout: bool = True) -> Path:
    """Write the figure as PNG at `path` and its numbers as JSON beside it (same name, .json); layout=False
    for a figure with a layout engine of its own."""

    import json

    path = Path(path)
    if layout:
        fig.tight_layout()
    summary = figure_summary(fig)
    metadata = {"Title": summary["title"], "Software": "lmkit", SUMMARY_KEY: json.dumps(summary, ensure_ascii=False)}
    atomic_save_file(path, lambda tmp: fig.savefig(tmp, format="png", metadata=metadata))
    if data is not None:
        atomic_write_json(path.with_suffix(".json"), data, indent=None)
    return path
