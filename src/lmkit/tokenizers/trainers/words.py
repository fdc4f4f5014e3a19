"""Word counting for trainers: each text goes through the tokenizer's added-token split, normalizer and
pre-tokenizer; trainers then work on unique words with their counts, never on the running text."""
from __future__ import annotations

import multiprocessing as mp
import os
from collections import Counter

from lmkit.errors import TokenizerError
from lmkit.tokenizers.fast import chunk_by_chars
from lmkit.tokenizers.pre_tokenizers import ByteLevel, byte_level

PARALLEL_MIN_CHARS = 2 << 20


def _count(tok, texts: list[str]) -> Counter:
    counts: Counter = Counter()
    pre, norm, added = tok.pre_tokenizer, tok.normalizer, tok.added
    raw = type(pre) is ByteLevel  # count raw regex pieces, map the unique ones to bytes afterwards
    for text in texts:
        pieces = [(p, first) for p, tid, first in added.split(text) if tid is None] if added.tokens else \
            [(norm.normalize(text) if norm else text, True)]
        for piece, first in pieces:
            if raw:
                counts.update(pre.raw_split(piece))
            elif pre is not None:
                counts.update(pre.split(piece, first))
            elif piece:
                counts[piece] += 1
    return counts


_WORKER = None


def _count_chunk(texts):
    return _count(_WORKER, texts)


def count_words(tok, texts, num_workers: int | None = None) -> dict[str, int]:
    """{pre-token: count} over `texts` (any iterable of str); big corpora are counted by a process pool."""
    texts = list(texts)
    for t in texts:
        if not isinstance(t, str):
            raise TokenizerError(f"training texts must be str, got {type(t).__name__}")
    total = sum(map(len, texts))
    workers = num_workers or os.cpu_count() or 1
    counts: Counter
    if workers > 1 and total >= PARALLEL_MIN_CHARS and len(texts) >= 2 * workers:
        global _WORKER
        _WORKER = tok
        chunks = chunk_by_chars(texts, max(1, total // (workers * 8)))
        try:
            with mp.get_context("fork").Pool(workers) as pool:
                counts = Counter()
                for part in pool.imap_unordered(_count_chunk, chunks):
                    counts.update(part)
        finally:
            _WORKER = None
    else:
        counts = _count(tok, texts)
    if type(tok.pre_tokenizer) is ByteLevel:
        mapped: dict[str, int] = {}
        for w, c in counts.items():
            k = byte_level(w)
            mapped[k] = mapped.get(k, 0) + c
        return mapped
    return dict(counts)
