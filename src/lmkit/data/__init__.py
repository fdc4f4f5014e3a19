"""Data: built-in corpora, user text files, the train/validation split, tokenization and batches."""
from lmkit.data.corpus import Corpus, Document, load_corpus

__all__ = ["Corpus", "Document", "load_corpus"]
