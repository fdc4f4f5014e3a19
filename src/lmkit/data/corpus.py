"""Corpora by name or path: the built-in corpora and user text files (plain text, folders, globs, JSONL),
and the checks that a run's outputs never overwrite or feed back into what a corpus reads. The documents,
the corpus and its train/validation split are `lmkit.data.documents`."""
from __future__ import annotations

import fnmatch
import glob as globlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from lmkit.data.builtin import BUILTIN, builtin_corpus
# Corpus, Document and split_hash are importable from here too, beside the readers that make them
from lmkit.data.documents import VAL_FRACTION, Corpus, Document, split_hash  # noqa: F401
from lmkit.errors import CorpusError

CHUNK_CHARS = 4000  # plain-text files are cut into documents of about this size (see chunk_text)


# user files ---------------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorpusError(f"corpus file {str(path)!r} does not exist; check the path") from None
    except OSError as exc:
        raise CorpusError(f"cannot read corpus file {str(path)!r}: {exc.strerror}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark (Windows editors) is not text
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus file {str(path)!r} is not UTF-8 (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                          "convert it, e.g. `iconv -f latin1 -t utf-8`") from None


def cut_point(text: str, start: int, max_chars: int) -> tuple[int, int]:
    """(end, next start) of the first piece of the over-long paragraph at text[start:].

    The piece ends at its last line break within max_chars characters, else at its last space, else
    after max_chars characters; the break itself is dropped. Only text[start:start + max_chars + 1] is read.
    """
    for sep in ("\n", " "):
        at = text.rfind(sep, start + 1, start + max_chars + 1)
        if at > start:
            return at, at + 1
    return start + max_chars, start + max_chars


def paragraphs(text: str, max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """text.split("\n\n"), a paragraph longer than max_chars cut into pieces at `cut_point`s."""
    for para in text.split("\n\n"):
        start = 0
        while len(para) - start > max_chars:
            end, start_next = cut_point(para, start, max_chars)
            yield para[start:end]
            start = start_next
        yield para[start:]


def group_paragraphs(paras: Iterable[str], max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Consecutive paragraphs joined by blank lines into pieces of at most about max_chars (blank pieces dropped)."""
    current: list[str] = []
    size = 0
    for para in paras:
        if current and size + len(para) > max_chars:
            piece = "\n\n".join(current)
            if piece.strip():
                yield piece
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    piece = "\n\n".join(current)
    if current and piece.strip():
        yield piece


def chunk_text(text: str, max_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut text at blank lines into pieces of at most about `max_chars` characters; a paragraph longer than
    that (a file without blank lines) is cut at line breaks, or spaces, so that no document grows unbounded."""
    return list(group_paragraphs(paragraphs(text, max_chars), max_chars))


def read_text_file(path: Path, label: str) -> list[Document]:
    return [Document(f"{label}#{i}", t) for i, t in enumerate(chunk_text(_read_text(path)))]


def read_jsonl(path: Path, label: str) -> list[Document]:
    """One document per line: an object with a string `text` (and optionally an `id`)."""
    lines = enumerate(_read_text(path).splitlines(), 1)
    return [doc for lineno, line in lines if (doc := jsonl_document(path, label, lineno, line)) is not None]


def jsonl_document(path: Path, label: str, lineno: int, line: str) -> Document | None:
    """The document of one JSONL line (None for a blank line or blank text); bad lines are a CorpusError."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{str(path)!r} line {lineno} is not JSON ({exc.msg}); each line must be an object with a 'text' field") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise CorpusError(f"{str(path)!r} line {lineno} has no string 'text' field; each line must look like {{\"text\": \"...\"}}")
    doc_id = str(obj["id"]) if "id" in obj else f"{label}:{lineno}"
    try:
        doc_id.encode("utf-8"), obj["text"].encode("utf-8")
    except UnicodeEncodeError:
        raise CorpusError(f"{str(path)!r} line {lineno} escapes a lone surrogate (\\ud800-\\udfff), which is not "
                          "text; fix or drop that line") from None
    return Document(doc_id, obj["text"]) if obj["text"].strip() else None


def _expand(spec: str) -> list[Path]:
    if any(c in spec for c in "*?["):
        matches = sorted(p for p in globlib.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(p))
        if not matches:
            raise CorpusError(f"no files match {spec!r}; check the pattern")
        return [Path(p) for p in matches]
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts))
        if not files:
            raise CorpusError(f"folder {spec!r} holds no files")
        return files
    if not path.exists():
        raise CorpusError(f"corpus {spec!r} is neither a built-in corpus (pydocs, pycode) nor an existing file; check the name or path")
    return [path]


def read_files(specs: Sequence[str]) -> list[Document]:
    """Documents from files, folders and glob patterns; `.jsonl` files hold one {"text": ...} per line."""
    docs: list[Document] = []
    for spec in specs:
        for path in _expand(spec):
            label = str(path)
            docs.extend(read_jsonl(path, label) if path.suffix == ".jsonl" else read_text_file(path, label))
    return docs


def resolved_sources(specs: Sequence[str]) -> set[str]:
    """The built-in corpus names and the resolved file paths that corpus specs read."""
    names: set[str] = set()
    for s in specs:
        if s in BUILTIN and not os.path.exists(s):  # as load_corpus reads it
            names.add(s)
        else:
            names.update(str(p.resolve()) for p in _expand(s))
    return names


def refuse_inputs(specs: Sequence[str], outputs: dict[str, str | Path] | Iterable[tuple[str, str | Path]]) -> None:
    """Raise when an output file ({flag: path}, or (flag, path) pairs) is one of the files the corpus specs read:
    writing it would destroy it."""
    sources = resolved_sources(specs)
    for flag, path in outputs.items() if isinstance(outputs, dict) else outputs:
        if str(Path(path).expanduser().resolve()) in sources:
            raise CorpusError(f"{flag} {path} is one of the corpus files and would be overwritten; write to a new file")


def refuse_output_folder(specs: Sequence[str], flag: str, folder: str | Path, written: Sequence[str]) -> None:
    """Raise when files written under `folder` (paths `written` relative to it) would overwrite a corpus file,
    or be read as text by the same corpus specs next time: `folder` at or inside a corpus folder, or a
    written path that a corpus glob matches."""
    refuse_inputs(specs, [(flag, Path(folder, name)) for name in written])
    root = Path(os.path.abspath(os.path.expanduser(folder)))
    for spec in specs:
        if spec in BUILTIN and not os.path.exists(spec):
            continue
        if any(c in spec for c in "*?["):
            pattern = Path(os.path.abspath(os.path.expanduser(spec))).parts
            hit = next((name for name in written if _glob_matches(pattern, (root / name).parts)), None)
            if hit is not None:
                raise CorpusError(f"{flag} {folder}: the run's {hit} would match --corpus {spec!r} and be read as "
                                  f"training text next time; choose a {flag} outside what the corpus reads")
        elif Path(spec).expanduser().is_dir():
            top = Path(os.path.abspath(os.path.expanduser(spec)))
            if (root == top or top in root.parents) and not any(p.startswith(".") for p in root.relative_to(top).parts):
                raise CorpusError(f"{flag} {folder} is inside the corpus folder {spec}: the run's files would be read as "
                                  f"training text next time; choose a {flag} outside it, or in a hidden folder "
                                  f"(its name starting with '.'), which a corpus folder skips")


def _glob_matches(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Whether path components `parts` match glob components `pattern` as glob.glob(recursive=True) would."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob_matches(rest, parts[i:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    return bool(parts) and (head.startswith(".") or not parts[0].startswith(".")) \
        and fnmatch.fnmatchcase(parts[0], head) and _glob_matches(rest, parts[1:])


def same_files(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two corpus specs name the same built-in corpora and files, however the paths are spelled
    (relative or absolute, a glob or its matches); False when either cannot be read from here."""
    try:
        return resolved_sources(a) == resolved_sources(b)
    except (CorpusError, OSError):
        return False


def load_corpus(spec: str | os.PathLike | Iterable[str | os.PathLike] = "pydocs") -> Corpus:
    """A built-in corpus by name (`pydocs`, `pycode`), or user text: files, folders, globs, JSONL.

    Several names/paths may be given; their documents are concatenated in the given order.
    """
    specs = [os.fspath(spec)] if isinstance(spec, (str, os.PathLike)) else [os.fspath(s) for s in spec]
    if not specs:
        raise CorpusError("no corpus given; name a built-in corpus (pydocs, pycode) or pass text files")
    docs: list[Document] = []
    for s in specs:
        if s in BUILTIN and not os.path.exists(s):
            docs.extend(builtin_corpus(s).documents)
        else:
            docs.extend(read_files([s]))
    if not docs:
        raise CorpusError(f"corpus {' '.join(specs)!r} is empty (no non-blank text); give files that contain text")
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise CorpusError(f"document id {d.id!r} appears twice; give each file (or JSONL 'id') once")
        seen.add(d.id)
    return Corpus("+".join(specs), docs)
