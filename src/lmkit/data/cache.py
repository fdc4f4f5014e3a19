"""The user's cache folder (atomic writes live in `lmkit.atomic`)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$XDG_CACHE_HOME/lmkit/...`, or `~/.cache/lmkit/...` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base, "lmkit", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path

