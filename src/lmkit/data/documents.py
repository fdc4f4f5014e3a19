"""Named documents and a corpus of them, with a deterministic train/validation split.

The split is by document: a document belongs to validation when the first 8 bytes of
sha256("lmkit-split-v1:" + id), read as an integer u, satisfy u / 2**64 < val_fraction.
It depends on nothing but the id, so it is stable across runs, machines and corpus order.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator

from lmkit.errors import CorpusError

SPLIT_SALT = "lmkit-split-v1:"
VAL_FRACTION = 0.05


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def split_hash(doc_id: str) -> float:
    """u / 2**64 in [0, 1) with u = the first 8 bytes of sha256(salt + id), big-endian."""
    digest = hashlib.sha256((SPLIT_SALT + doc_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class Corpus:
    """A named list of documents; `split()` gives (train, validation)."""

    name: str
    documents: list[Document] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.documents)

    def __iter__(self) -> Iterator[Document]:
        return iter(self.documents)

    def texts(self) -> list[str]:
        return [d.text for d in self.documents]

    @property
    def num_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.documents)

    def fingerprint(self) -> str:
        """sha256 over ids and texts: names this exact content in cache keys."""
        h = hashlib.sha256()
        for d in self.documents:
            for part in (d.id, d.text):
                b = part.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
        return h.hexdigest()

    def split(self, val_fraction: float = VAL_FRACTION) -> tuple["Corpus", "Corpus"]:
        """(train, validation) by the hash of each document id (see module docstring).

        With two or more documents both sides are non-empty: if the hash puts none in
        validation, the document with the smallest hash goes there (and the largest to train).
        """
        if not 0.0 < val_fraction < 1.0:
            raise CorpusError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
        if len(self.documents) < 2:
            raise CorpusError(f"corpus {self.name!r} has {len(self.documents)} document(s); "
                              "a train/validation split needs at least two (add more text)")
        hashes = [split_hash(d.id) for d in self.documents]
        is_val = [h < val_fraction for h in hashes]
        if not any(is_val):
            is_val[min(range(len(hashes)), key=hashes.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(hashes)), key=hashes.__getitem__)] = False
        train = [d for d, v in zip(self.documents, is_val) if not v]
        val = [d for d, v in zip(self.documents, is_val) if v]
        return Corpus(f"{self.name}/train", train), Corpus(f"{self.name}/validation", val)

    def head(self, n: int) -> "Corpus":
        """The first `n` documents (small slices for tests and smoke runs)."""
        return Corpus(self.name, self.documents[:n])
