"""Atomic file writes: write to a temporary name in the target's folder, flush, fsync, then rename.

Readers see either the old file or the whole new one; a crash or an error leaves no half-written
file behind (the temporary file is removed).
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def _temporary_beside(path: str | os.PathLike) -> Iterator[tuple[int, Path]]:
    """(fd, temporary path) in path's folder, renamed onto path when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the file the usual mode
        yield fd, Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None):
    """A file object to write `path` through; it appears at `path` only if the block succeeds."""
    with _temporary_beside(path) as (fd, _):
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def atomic_save_file(path: str | os.PathLike, save: Callable[[str], None]) -> None:
    """Call `save(tmp_path)` (e.g. safetensors' `save_file`) and move the result onto `path`."""
    with _temporary_beside(path) as (fd, tmp):
        os.close(fd)
        save(str(tmp))
        os.chmod(tmp, 0o666 & ~umask())  # the saver may have replaced the file (safetensors writes it 0600)
