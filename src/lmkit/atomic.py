"""Atomic file writes: write to a temporary name in the target's folder, flush, fsync, then rename.

Readers see either the old file or the whole new one; a crash or an error leaves no half-written
file behind (the temporary file is removed). `staged_folder` does the same for a folder of files.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
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
    if path.is_dir():  # the rename would fail only after all the work, naming the temporary file
        raise IsADirectoryError(errno.EISDIR, "it is a folder, not a file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # name the file the user asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
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


@contextmanager
def staged_folder(path: str | os.PathLike, last: tuple[str, ...] = (), remove: Callable[[Path], bool] | None = None
                  ) -> Iterator[Path]:
    """A temporary folder beside `path` to write into; its files move into `path` only if the block succeeds.

    A new `path` appears whole (one rename). Into an existing folder the files are renamed one by one,
    the names in `last` last (write the file that makes the folder valid there, e.g. an index), after
    deleting the old `last` files and the files `remove(file)` selects. On error nothing in `path` changes.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        os.chmod(tmp, 0o777 & ~umask())
        yield tmp
        if not path.exists():
            os.rename(tmp, path)
            return
        for name in last:
            (path / name).unlink(missing_ok=True)
        for old in path.iterdir():
            if remove is not None and old.is_file() and not (tmp / old.name).exists() and remove(old):
                old.unlink()
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n not in last] + [n for n in last if n in names]:
            os.replace(tmp / name, path / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
