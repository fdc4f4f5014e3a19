"""Ranked chunks by dense cosine, BM25, or both fused by reciprocal rank.

Reciprocal rank fusion (Cormack et al. 2009): score(c) = sum over rankings r of 1 / (K + rank_r(c)),
rank from 1, K = 60, a chunk absent from a ranking adding nothing. Each ranking is taken `depth` deep
(at least 50, at least 4k) so a chunk second-best in both lists can beat one first in a single list.
"""
from __future__ import annotations

from dataclasses import dataclass

from lmkit.errors import ConfigError

MODES = ("dense", "bm25", "hybrid")
RRF_K = 60


@dataclass(frozen=True)
class Hit:
    source: str   # the document id
    score: float  # cosine (dense), BM25 score (bm25) or fused reciprocal rank (hybrid)
    text: str
    chunk: int    # the chunk's id in the index
    n: int        # the chunk's place in its document

    def to_json(self) -> dict:
        return {"source": self.source, "score": self.score, "text": self.text}


def rrf(rankings: list[list[int]], k0: int = RRF_K) -> list[tuple[int, float]]:
    """Fused (id, score), best first; ties keep the order in which ids were first met."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k0 + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def retrieve(index, query: str, k: int = 5, mode: str = "hybrid") -> list[Hit]:
    """The k best chunks of `index` (a RagIndex) for `query`, best first."""
    if mode not in MODES:
        raise ConfigError(f"retrieval mode {mode!r} is unknown; use one of {', '.join(MODES)}")
    if k < 1:
        raise ConfigError(f"k must be at least 1, got {k}")
    if mode == "dense":
        ranked = index.dense(query, k)
    elif mode == "bm25":
        ranked = index.bm25(query, k)
    else:
        depth = max(50, 4 * k)
        ranked = rrf([[i for i, _ in index.dense(query, depth)], [i for i, _ in index.bm25(query, depth)]])[:k]
    return [Hit(index.chunks[i].source, score, index.chunks[i].text, i, index.chunks[i].n) for i, score in ranked]
