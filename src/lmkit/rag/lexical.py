"""BM25 over chunk texts with bm25s (Lucene's BM25: k1 = 1.5, b = 0.75), English stopwords, no stemming.

score(q, d) = sum over query terms t of idf(t) * f(t, d) * (k1 + 1) / (f(t, d) + k1 * (1 - b + b * |d| / avgdl)).
The statistics (idf, avgdl) belong to the whole collection, so adding or removing chunks recomputes them
from the stored texts; that is a tokenizer pass, no embedding.
"""
from __future__ import annotations

from pathlib import Path

STOPWORDS = "en"


def _tokenize(texts: list[str], **kwargs):
    import bm25s

    return bm25s.tokenize(texts, stopwords=STOPWORDS, show_progress=False, **kwargs)


class Lexical:
    """A bm25s index over rows 0..N-1 of a list of chunk texts."""

    def __init__(self, retriever, size: int):
        self.retriever, self.size = retriever, size

    @classmethod
    def build(cls, texts: list[str]) -> "Lexical":
        import bm25s

        retriever = bm25s.BM25()
        if texts:
            retriever.index(_tokenize(texts), show_progress=False)
        return cls(retriever, len(texts))

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """(row, BM25 score) of the best k rows with a score above 0 (sharing a term with the query), best first."""
        k = min(k, self.size)
        if k < 1:
            return []
        terms = _tokenize([query], return_ids=False)
        if not terms[0]:
            return []
        rows, scores = self.retriever.retrieve(terms, k=k, show_progress=False, n_threads=1)
        return [(int(r), float(s)) for r, s in zip(rows[0], scores[0]) if s > 0]

    def save(self, folder: Path) -> None:
        if self.size:
            self.retriever.save(str(folder))

    @classmethod
    def load(cls, folder: Path, size: int) -> "Lexical":
        import bm25s

        if not size:
            return cls.build([])
        # bm25s stores numpy arrays (.npy, read without pickle) and JSON
        return cls(bm25s.BM25.load(str(folder), allow_pickle=False), size)

