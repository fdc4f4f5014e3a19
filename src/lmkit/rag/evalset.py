"""A deterministic retrieval benchmark over the interpreter's documentation (the `pydocs` docstrings).

Every documented class or function of the standard library is an entry: its dotted name, a summary (the
docstring's first paragraph) and a body (the rest). The corpus holds each chosen entry's name and body,
the summary held out; the query for an entry is its summary rewritten so it is not a copy of any indexed
text: the words naming the entry (parts of its dotted name) and identifiers (with `_`, `.`, `(`, backquotes)
are removed, and common words are replaced by a fixed synonym table ("Return a new list" becomes "give
back a fresh sequence"). The one relevant document of a query is its entry, known by construction.
Entries are chosen by sha256 of their name, so the set depends only on the interpreter.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from lmkit.data.corpus import Document

SYNONYMS = {
    "return": "give back", "returns": "gives back", "returned": "given back", "create": "make", "creates": "makes",
    "new": "fresh", "string": "text", "strings": "texts", "list": "sequence", "lists": "sequences",
    "remove": "delete", "removes": "deletes", "get": "fetch", "gets": "fetches", "set": "assign", "sets": "assigns",
    "number": "count", "check": "test", "checks": "tests", "whether": "if", "object": "instance",
    "objects": "instances", "value": "quantity", "values": "quantities", "initialize": "prepare",
    "method": "routine", "function": "routine", "called": "invoked", "call": "invoke", "read": "load",
    "reads": "loads", "write": "output", "writes": "outputs", "default": "standard", "error": "failure",
    "convert": "turn", "converts": "turns", "current": "present", "specified": "requested", "given": "supplied",
    "name": "label", "names": "labels", "data": "content", "item": "element", "items": "elements", "add": "append",
    "adds": "appends", "start": "begin", "end": "finish", "size": "length", "true": "truthy", "false": "falsy",
    "file": "file on disk", "files": "files on disk", "class": "type", "instance": "object", "containing": "holding",
    "contains": "holds", "all": "every", "each": "every", "specific": "particular", "used": "employed",
    "use": "employ", "make": "produce", "makes": "produces", "find": "locate", "finds": "locates",
}
IDENTIFIER = re.compile(r"[_.()`*=<>\[\]{}:/\\]|\d")
WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


@dataclass(frozen=True)
class Entry:
    name: str
    summary: str
    body: str


@dataclass(frozen=True)
class Query:
    text: str
    relevant: str  # the id of the one relevant document


def entries(documents) -> list[Entry]:
    """The class and function entries of pydocs' `doc:` documents (a header line holding the dotted name)."""
    out = []
    for doc in documents:
        if not doc.id.startswith("doc:"):
            continue
        module = doc.id[4:]
        header = re.compile(rf"^{re.escape(module)}\.[\w.]+$")
        lines = doc.text.split("\n")
        starts = [i for i, line in enumerate(lines) if header.match(line) and (i == 0 or not lines[i - 1].strip())]
        for a, b in zip(starts, starts[1:] + [len(lines)]):
            text = "\n".join(lines[a + 1:b]).strip()
            summary, _, body = text.partition("\n\n")
            out.append(Entry(lines[a], " ".join(summary.split()), body.strip()))
    return out


def rewrite(summary: str, name: str) -> str:
    """The summary without the entry's own name parts or identifiers, common words swapped for synonyms."""
    parts = {p.lower() for p in re.split(r"[._]", name) if p}
    words = []
    for token in summary.split():
        if IDENTIFIER.search(token.strip(".,;:!?\"'")):
            continue
        for w in WORD.findall(token):
            low = w.lower()
            if low in parts:
                continue
            words.append(SYNONYMS.get(low, low))
    return " ".join(words)


def build(documents, n_docs: int = 400, n_queries: int = 100) -> tuple[list[Document], list[Query]]:
    """(corpus, queries): n_docs entries with a 6-40 word summary and a 25+ word body, the first n_queries
    of them (by the same hash order) asked about."""
    usable = [e for e in entries(documents) if 6 <= len(e.summary.split()) <= 40 and len(e.body.split()) >= 25]
    usable.sort(key=lambda e: hashlib.sha256(e.name.encode()).hexdigest())
    chosen = usable[:n_docs]
    corpus = [Document(e.name, f"{e.name}\n{e.body}") for e in chosen]
    queries = []
    for e in chosen:
        text = rewrite(e.summary, e.name)
        if len(text.split()) >= 6 and len(queries) < n_queries:
            queries.append(Query(text, e.name))
    return corpus, queries


def rank_of(relevant: str, sources: list[str]) -> int | None:
    """The 1-based rank of the first result from the relevant document, None if absent."""
    return next((i for i, s in enumerate(sources, 1) if s == relevant), None)


def scores(ranks: list[int | None], cutoffs=(1, 5, 10)) -> dict[str, float]:
    """recall@k (the relevant document in the top k) and MRR@max(cutoffs) (1/rank, 0 when absent)."""
    n, top = max(len(ranks), 1), max(cutoffs)
    out = {f"recall@{k}": sum(r is not None and r <= k for r in ranks) / n for k in cutoffs}
    out[f"mrr@{top}"] = sum(1.0 / r for r in ranks if r is not None and r <= top) / n
    return out
