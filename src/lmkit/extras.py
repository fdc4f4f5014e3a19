"""The optional extras of pyproject.toml and the modules each one brings: a command whose optional part is missing
says, in one line, which extra to install (`pip install 'lmkit[serve]'`), rather than ending in a traceback."""
from __future__ import annotations

import importlib

from lmkit.errors import LmkitError

# top-level module -> the extra of pyproject.toml that installs it
EXTRAS = {"fastapi": "serve", "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve",
          "xgrammar": "serve", "lm_eval": "eval", "nltk": "eval", "faiss": "rag", "bm25s": "rag", "lingua": "data",
          "mkdocs": "docs"}


class MissingExtraError(LmkitError, ImportError):
    """An optional dependency that is not installed; the message names the extra that installs it."""


def message(module: str, what: str | None = None) -> str:
    """The one line for `module` missing (`what`: the part of lmkit that needs it)."""
    extra = EXTRAS.get(module.split(".")[0])
    need = f"{what} needs {module}" if what else f"{module} is needed"
    if extra is None:
        return f"{need}, which is not installed; pip install {module}"
    return f"{need}, which is not installed; install lmkit's {extra} extra: pip install 'lmkit[{extra}]'"


def require(module: str, what: str | None = None):
    """Import and return `module`, or raise `MissingExtraError` naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the module is there but something it imports is not: its own bug or install
        raise MissingExtraError(message(module, what)) from None


def missing_extra(exc: BaseException, what: str | None = None) -> MissingExtraError | None:
    """The `MissingExtraError` for `exc` when it is a ModuleNotFoundError of a module an extra installs, else None."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not name or name.split(".")[0] not in EXTRAS:
        return None
    return MissingExtraError(message(name.split(".")[0], what))
