"""Token ids of a corpus, packed rows for training, padded rows for evaluation.

Packing: every document is cut into pieces of at most `seq_len` tokens and the pieces are
laid end to end, each preceded by BOS: stream = BOS p_1 BOS p_2 ... . A training row is
the `seq_len + 1` tokens of the stream (read circularly) that start at the BOS of a piece,
so every row begins with BOS. The pieces a global batch starts at are drawn by a
generator seeded with (seed, step) alone: the batch of a step is a pure function of
(seed, step), and rank r of w processes takes the rows r*B/w .. (r+1)*B/w - 1.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from lmkit.atomic import atomic_save_file
from lmkit.data.cache import cache_dir
from lmkit.data.corpus import Corpus
from lmkit.data.tokenize import tokenizer_sha
from lmkit.errors import CorpusError, TrainingError

TOKEN_CACHE_VERSION = 1


@dataclass
class TokenizedCorpus:
    """tokens: ids of all documents end to end; offsets (n + 1): where each starts; nbytes (n): UTF-8 bytes."""

    tokens: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def _encode_all(tok: Any, texts: list[str]) -> list[list[int]]:
    if hasattr(tok, "encode_batch"):
        out = tok.encode_batch(texts, add_special_tokens=False)
    else:
        out = [tok.encode(t, add_special_tokens=False) for t in texts]
    return [list(getattr(ids, "ids", ids)) for ids in out]


def tokenize_corpus(corpus: Corpus, tok: Any, use_cache: bool = True) -> TokenizedCorpus:
    """Ids of every document (no special tokens), cached as safetensors by tokenizer and corpus."""
    key = json.dumps([TOKEN_CACHE_VERSION, tokenizer_sha(tok), corpus.fingerprint()])
    path = cache_dir("tokens") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"
    if use_cache and path.exists():
        try:
            arrays = load_file(str(path))
            return TokenizedCorpus(arrays["tokens"], arrays["offsets"], arrays["nbytes"])
        except Exception:  # a damaged cache entry is rebuilt below
            pass
    texts = corpus.texts()
    ids: list[list[int]] = []
    for start in range(0, len(texts), 64):  # bounded memory per call
        ids.extend(_encode_all(tok, texts[start:start + 64]))
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
    nbytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    result = TokenizedCorpus(tokens, offsets, nbytes)
    if use_cache:
        atomic_save_file(path, lambda tmp: save_file({"tokens": tokens, "offsets": offsets, "nbytes": nbytes}, tmp))
    return result


def pieces(tc: TokenizedCorpus, seq_len: int) -> Iterator[tuple[int, np.ndarray]]:
    """(document index, piece) for every document cut into pieces of at most seq_len tokens."""
    for i in range(len(tc)):
        doc = tc.document(i)
        for start in range(0, len(doc), seq_len):
            yield i, doc[start:start + seq_len]


class PackedStream:
    """Training rows of seq_len + 1 tokens from the packed stream (see module docstring)."""

    def __init__(self, tc: TokenizedCorpus, bos_id: int, seq_len: int):
        if seq_len < 1:
            raise TrainingError(f"seq_len must be a positive integer, got {seq_len}")
        if tc.num_tokens == 0:
            raise CorpusError("the training text encodes to no tokens; give a corpus that contains text")
        parts, starts, pos = [], [], 0
        for _, piece in pieces(tc, seq_len):
            starts.append(pos)
            parts.append(np.array([bos_id], dtype=np.int64))
            parts.append(piece.astype(np.int64))
            pos += 1 + len(piece)
        self.stream = torch.from_numpy(np.concatenate(parts))
        if seq_len >= len(self.stream):  # a row would wrap around and repeat the whole split
            raise CorpusError(f"the training split holds {len(self.stream)} tokens (BOS markers included), fewer than one "
                              f"row of {seq_len + 1}; give more text or lower --seq-len")
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.seq_len = seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.stream)

    def global_rows(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        """The (batch_size, seq_len + 1) rows of optimizer step `step`: a function of (seed, step) only."""
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") >> 1)
        which = torch.randint(len(self.starts), (batch_size,), generator=g)
        index = (self.starts[which, None] + torch.arange(self.seq_len + 1)) % len(self.stream)
        return self.stream[index]

    def rows(self, seed: int, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """This rank's share of the global batch of `step` (batch_size must divide by world_size)."""
        if batch_size % world_size:
            raise TrainingError(f"--batch-size {batch_size} is not divisible by the {world_size} processes; pick a multiple")
        per = batch_size // world_size
        return self.global_rows(seed, step, batch_size)[rank * per:(rank + 1) * per]


def eval_rows(tc: TokenizedCorpus, bos_id: int, pad_id: int, seq_len: int,
              max_docs: int | None = None, stride: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows (N, seq_len + 1), mask, UTF-8 bytes scored) that score every token once.

    Each document of the first `max_docs` is cut into pieces of seq_len tokens; a row is BOS
    followed by a piece, right-padded with pad_id (mask 0). With `stride`, rows are overlapping
    windows of seq_len tokens instead (`strided_rows`) and the mask marks the tokens each one scores.
    """
    n = len(tc) if max_docs is None else min(max_docs, len(tc))
    sub = TokenizedCorpus(tc.tokens, tc.offsets[:n + 1], tc.nbytes[:n])
    if stride is not None:
        return (*strided_rows(sub, bos_id, pad_id, seq_len, stride), int(sub.nbytes.sum()))
    chunks = [piece for _, piece in pieces(sub, seq_len)]
    rows = torch.full((len(chunks), seq_len + 1), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(rows)
    for r, piece in enumerate(chunks):
        rows[r, 0] = bos_id
        rows[r, 1:1 + len(piece)] = torch.from_numpy(piece.astype(np.int64))
        mask[r, :1 + len(piece)] = 1
    return rows, mask, int(sub.nbytes.sum())


def strided_rows(tc: TokenizedCorpus, bos_id: int, pad_id: int, context: int,
                 stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (N, context), mask) of sliding windows, as in transformers' perplexity guide for fixed-length models.

    A document reads s = BOS t_1 .. t_n; window k is s[k*stride : k*stride + context] (the model reads all
    but its last token), until a window reaches t_n. A window scores (mask 1) only the tokens past those of
    the window before, so every token is scored once, after at least context - stride tokens of
    context (fewer near the start of the document). Rows are right-padded with pad_id.
    """
    if not 1 <= stride < context:
        raise CorpusError(f"the stride must be at least 1 and below the {context}-token context, got {stride}; "
                          "without a stride, documents are read in pieces of the context")
    windows: list[tuple[np.ndarray, int]] = []  # (window, first position it scores)
    for i in range(len(tc)):
        s = np.concatenate([[bos_id], tc.document(i)]).astype(np.int64)
        end = 1  # s[0] (BOS) is never a target; s[1:end] were scored by earlier windows
        for begin in range(0, len(s), stride):
            window = s[begin:begin + context]
            windows.append((window, end - begin))
            end = begin + len(window)
            if end == len(s):
                break
    rows = torch.full((len(windows), context), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(rows)
    for r, (window, first) in enumerate(windows):
        rows[r, :len(window)] = torch.from_numpy(window)
        mask[r, first:len(window)] = 1
    return rows, mask
