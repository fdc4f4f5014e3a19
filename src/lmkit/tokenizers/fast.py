"""Fast paths: tiktoken as the engine of byte-level BPE, and process-parallel batches for the Python pipeline.

tiktoken merges the adjacent pair whose concatenation has the lowest rank, and returns ranks as ids. That is
HF's BPE when (1) every merged token is made by exactly one merge, (2) merge results get ids in merge order
and (3) only single bytes and merge results are ranked; the engine is built only then, and only when the
rest of the pipeline is plain byte-level (no normalizer, GPT-2 or a Split regex, plain special tokens).
"""
from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ThreadPoolExecutor

import regex

from lmkit.tokenizers.chars import CHAR_TO_BYTE
from lmkit.tokenizers.models.bpe import BPE
from lmkit.tokenizers.pre_tokenizers import GPT2_PATTERN, ByteLevel, Sequence, Split

PARALLEL_MIN_CHARS = 1 << 20  # below this, starting processes costs more than it saves
_ANCHOR = regex.compile(r"(?<![\[\\])\^|(?<!\\)\$")


class TiktokenEngine:
    def __init__(self, encoding):
        self.encoding = encoding

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all", disallowed_special=())

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        return [self.encoding.encode(t, allowed_special="all", disallowed_special=()) for t in texts]

    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """The texts in a few contiguous chunks per thread (tiktoken releases the GIL while it encodes).
        tiktoken's own encode_batch submits one task per text: on many short texts (lines, as `datasets.map`
        feeds them) the thread pool's bookkeeping then costs more than the encoding."""
        if num_threads <= 1 or len(texts) < 2 * num_threads:
            return self.encode_all(texts)
        size = -(-len(texts) // (4 * num_threads))  # 4 chunks per thread even out long and short texts
        with ThreadPoolExecutor(num_threads) as pool:
            parts = pool.map(self.encode_all, [texts[i:i + size] for i in range(0, len(texts), size)])
            return [ids for part in parts for ids in part]


def _pattern(pre) -> str | None:
    if type(pre) is ByteLevel and pre.use_regex and not pre.add_prefix_space:
        return GPT2_PATTERN
    if type(pre) is Sequence and len(pre.pretokenizers) == 2:
        split, bl = pre.pretokenizers
        if (type(split) is Split and "Regex" in split.pattern and split.behavior == "Isolated" and not split.invert
                and type(bl) is ByteLevel and not bl.use_regex and not bl.add_prefix_space
                and not _ANCHOR.search(split.pattern["Regex"])):  # tiktoken's ^ and $ are not per line
            return split.pattern["Regex"]
    return None


def _to_bytes(token: str) -> bytes | None:
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return None


def tiktoken_engine(tok) -> TiktokenEngine | None:
    """A tiktoken Encoding with the same ranks as `tok`'s BPE, or None when tiktoken cannot match it exactly."""
    if os.environ.get("LMKIT_NO_TIKTOKEN"):
        return None
    model = tok.model
    if type(model) is not BPE or tok.normalizer is not None or model.prefix or model.suffix or model.byte_fallback:
        return None
    pattern = _pattern(tok.pre_tokenizer)
    if pattern is None:
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    ranks: dict[bytes, int] = {}
    for token, tid in model.vocab.items():
        if len(token) == 1:
            b = _to_bytes(token)
            if b is None:
                return None
            ranks[b] = tid
    if len(ranks) != 256:
        return None
    last = -1
    for a, b in model.merges:
        new = model.merged[(a, b)]
        nb, tid = _to_bytes(new), model.vocab[new]
        if nb is None or nb in ranks or tid <= last:  # made twice, or ids not in merge order
            return None
        ranks[nb], last = tid, tid
    if len(set(ranks.values())) != len(ranks):
        return None
    if model.ignore_merges:  # HF then takes any whole word found in the vocabulary, tiktoken only ranked ones
        added = {t.content for t in tok.added.tokens}
        if any(_to_bytes(t) not in ranks for t in model.vocab if t not in added):
            return None
    specials = {}
    for t in tok.added.tokens:
        if t.lstrip or t.rstrip or t.single_word:
            return None
        specials[t.content] = t.id
    contents = list(specials)
    if any(a != b and a in b for a in contents for b in contents):
        return None  # tiktoken's special matching is leftmost-first, HF's leftmost-longest
    by_id = {tid: b for b, tid in ranks.items()}
    for content, tid in specials.items():  # an added token may share its id only with its own bytes
        if tid in by_id and by_id[tid] != _to_bytes(content):
            return None
    try:
        enc = tiktoken.Encoding("lmkit", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except Exception:  # a regex fancy-regex rejects, or ranks tiktoken refuses: use the Python path
        return None
    return TiktokenEngine(enc)


_WORKER_TOK = None


def _worker_encode(texts: list[str]) -> list[list[int]]:
    return [_WORKER_TOK._encode_plain(t, python_only=True) for t in texts]


def encode_many(tok, texts: list[str], num_workers: int | None = None) -> list[list[int]]:
    """Ids of each text without post-processing, as fast as this machine allows."""
    workers = num_workers or os.cpu_count() or 1
    engine = tok.engine()
    if engine is not None:
        return engine.encode_batch(texts, max(1, workers))
    total = sum(len(t) for t in texts)
    if workers <= 1 or total < PARALLEL_MIN_CHARS or len(texts) < 2:
        return [tok._encode_plain(t, python_only=True) for t in texts]
    try:
        ctx = mp.get_context("fork")
    except ValueError:
        return [tok._encode_plain(t, python_only=True) for t in texts]
    global _WORKER_TOK
    _WORKER_TOK = tok
    # chunks of about equal character count keep both workers busy
    chunks = chunk_by_chars(texts, max(1, total // (workers * 4)))
    try:
        with ctx.Pool(workers) as pool:
            parts = pool.map(_worker_encode, chunks)
    finally:
        _WORKER_TOK = None
    return [ids for part in parts for ids in part]


def chunk_by_chars(texts, target: int) -> list[list[str]]:
    """Consecutive texts grouped into chunks of about `target` characters (for a worker pool)."""
    chunks, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= target:
            chunks.append(cur)
            cur, size = [], 0
    if cur:
        chunks.append(cur)
    return chunks
