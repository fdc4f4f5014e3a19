"""Sentence embeddings and semantic search: `SentenceEncoder` reads a sentence-transformers folder
(`encoder.py`), pools token states and applies Dense and precision (`pooling.py`), and `SemanticIndex`
ranks passages by cosine (`search.py`)."""
from __future__ import annotations

from lmkit.sentence.encoder import SentenceEncoder, length_batches
from lmkit.sentence.pooling import QUANTIZE, Dense, dense_activation, pool_tokens, quantize
from lmkit.sentence.search import SemanticIndex, paragraphs, top_k

__all__ = ["SentenceEncoder", "Dense", "pool_tokens", "dense_activation", "quantize", "QUANTIZE", "length_batches",
           "SemanticIndex", "paragraphs", "top_k"]
