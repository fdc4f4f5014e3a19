"""Built-in corpora, built from the running interpreter (nothing is downloaded).

`pydocs`: the reference topics of `pydoc_data.topics` (one document per topic) and every
docstring of the standard library, read with `ast` (one document per module: each docstring
under its dotted name). `pycode`: the standard library's source, one document per module.
Test folders, `site-packages` and files that do not parse are left out. Files are visited in
sorted order, so the corpus is a deterministic function of the interpreter; it is cached as
JSON under the user's cache folder, keyed by the Python version and the stdlib path, with the
corpus fingerprint that a cached copy must match to be used.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Callable, Iterator

from lmkit.atomic import atomic_write_json
from lmkit.data.cache import cache_dir
from lmkit.data.documents import Corpus, Document
from lmkit.errors import CorpusError

FORMAT_VERSION = 1
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every stdlib .py file outside test folders, sorted."""
    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = Path(dirpath, name)
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts) or "__init__", path


def _parse(path: Path) -> tuple[str, ast.Module] | None:
    try:
        source = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            return source, ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _docstrings(tree: ast.Module, module: str) -> list[tuple[str, str]]:
    """(dotted name, cleaned docstring) of the module, its classes and functions, in source order."""
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    out.append((name, doc))
                visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc:
        out.append((module, doc))
    visit(tree, module)
    return out


def build_pydocs() -> list[Document]:
    from pydoc_data.topics import topics

    docs = [Document(f"topic:{name}", topics[name].strip()) for name in sorted(topics) if topics[name].strip()]
    for module, path in stdlib_files():
        parsed = _parse(path)
        if parsed is None:
            continue
        entries = _docstrings(parsed[1], module)
        if entries:
            docs.append(Document(f"doc:{module}", "\n\n".join(f"{name}\n{doc}" for name, doc in entries)))
    return docs


def build_pycode() -> list[Document]:
    docs = []
    for module, path in stdlib_files():
        parsed = _parse(path)
        if parsed is not None and parsed[0].strip():
            docs.append(Document(f"src:{module}", parsed[0]))
    return docs


BUILTIN: dict[str, Callable[[], list[Document]]] = {"pydocs": build_pydocs, "pycode": build_pycode}


def _cache_path(name: str) -> Path:
    key = json.dumps([FORMAT_VERSION, name, sys.version, str(stdlib_root())])
    return cache_dir("corpora") / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def builtin_corpus(name: str, use_cache: bool = True) -> Corpus:
    """The built-in corpus `name`, read from the cache or built and cached (atomically)."""
    if name not in BUILTIN:
        raise CorpusError(f"unknown built-in corpus {name!r}; choose one of {', '.join(BUILTIN)}")
    path = _cache_path(name)
    if use_cache and path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            corpus = Corpus(name, [Document(i, t) for i, t in data["documents"]])
            if data["name"] == name and data["fingerprint"] == corpus.fingerprint():
                return corpus
        except (ValueError, KeyError, TypeError):
            pass
        # a damaged (or edited) cache file is rebuilt below
    docs = BUILTIN[name]()
    if not docs:
        raise CorpusError(f"built-in corpus {name!r} came out empty: this Python has no standard library sources at {stdlib_root()}")
    corpus = Corpus(name, docs)
    if use_cache:
        atomic_write_json(path, {"name": name, "python": sys.version, "fingerprint": corpus.fingerprint(),
                                 "documents": [[d.id, d.text] for d in docs]}, indent=None)
    return corpus
