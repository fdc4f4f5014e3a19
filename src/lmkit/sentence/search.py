"""Semantic search over passages: embed them with a SentenceEncoder, rank by cosine q.e / (|q| |e|)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.atomic import atomic_write_json
from lmkit.hub.files import atomic_save_safetensors, load_safetensors, read_json

if TYPE_CHECKING:
    from lmkit.sentence.encoder import SentenceEncoder


def paragraphs(documents, min_chars: int = 40) -> tuple[list[str], list[str]]:
    """(passages, ids): the blank-line-separated blocks of at least min_chars characters, whitespace
    collapsed; ids are "document id#n". `documents` holds objects with .id and .text (lmkit Documents)."""
    passages, ids = [], []
    for doc in documents:
        for n, block in enumerate(doc.text.split("\n\n")):
            text = " ".join(block.split())
            if len(text) >= min_chars:
                passages.append(text)
                ids.append(f"{doc.id}#{n}")
    return passages, ids


def top_k(query: np.ndarray, embeddings: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    """The k rows of embeddings with the largest cosine q.e / (|q| |e|) to query, best first: (row, cosine)."""
    q = query / max(float(np.linalg.norm(query)), 1e-12)
    norms = np.maximum(np.linalg.norm(embeddings, axis=1), 1e-12)
    scores = embeddings @ q / norms
    k = min(k, len(scores))
    best = np.argpartition(-scores, k - 1)[:k] if k else np.array([], dtype=int)
    best = best[np.argsort(-scores[best], kind="stable")]
    return [(int(i), float(scores[i])) for i in best]


class SemanticIndex:
    """Passages and their embeddings; `search(query, k)` ranks passages by cosine to the query's embedding.

    save/load write the embeddings as safetensors and the passages as JSON (atomically)."""

    def __init__(self, encoder: SentenceEncoder, passages: list[str], ids: list[str], embeddings: np.ndarray):
        if not (len(passages) == len(ids) == len(embeddings)):
            raise ValueError("passages, ids and embeddings must have the same length")
        self.encoder, self.passages, self.ids, self.embeddings = encoder, passages, ids, embeddings

    @classmethod
    def build(cls, encoder: SentenceEncoder, passages: list[str], ids: list[str], batch_size: int = 64,
              show_progress_bar: bool = False) -> "SemanticIndex":
        return cls(encoder, passages, ids, encoder.encode(passages, batch_size=batch_size,
                                                          show_progress_bar=show_progress_bar))

    def search(self, query: str, k: int = 5) -> list[tuple[float, str, str]]:
        """(cosine, id, passage) of the k best passages, best first."""
        return [(score, self.ids[i], self.passages[i]) for i, score in top_k(self.encoder.encode(query), self.embeddings, k)]

    def save(self, path) -> None:
        folder = Path(path)
        atomic_save_safetensors({"embeddings": torch.from_numpy(np.ascontiguousarray(self.embeddings))},
                                folder / "embeddings.safetensors")
        atomic_write_json(folder / "passages.json", {"ids": self.ids, "passages": self.passages}, sort_keys=True)

    @classmethod
    def load(cls, encoder: SentenceEncoder, path) -> "SemanticIndex":
        folder = Path(path)
        data = read_json(folder / "passages.json", "a semantic search index needs it; build it again")
        emb = load_safetensors(folder / "embeddings.safetensors")["embeddings"].numpy()
        return cls(encoder, data["passages"], data["ids"], emb)
