"""Retrieval-augmented generation: chunk and index documents with a sentence encoder (faiss) and BM25
(bm25s), retrieve by dense, lexical or fused rank, and answer from numbered sources."""
from lmkit.rag.chunks import Chunk, chunk_document
from lmkit.rag.retrieve import Hit, retrieve, rrf
from lmkit.rag.store import RagIndex

__all__ = ["Chunk", "chunk_document", "Hit", "RagIndex", "retrieve", "rrf"]
