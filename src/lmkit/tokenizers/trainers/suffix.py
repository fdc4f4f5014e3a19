"""Repeated substrings through a suffix array: the internal nodes of the suffix tree that SentencePiece's and
Hugging Face's esaxx enumerate to seed a Unigram vocabulary.

The suffix array orders the suffixes of T by their first `depth` characters only, by prefix doubling
(rank_2h(i) = (rank_h(i), rank_h(i + h))): a piece of fewer than `depth` characters needs no more.
lcp(k), the common prefix length of the k-th and (k+1)-th sorted suffixes capped at `depth`, comes from the
same rank tables by binary lifting. An lcp-interval [lo, hi) of depth d (lcp >= d inside it, < d at both
ends, = d somewhere) is an internal node of the suffix tree: its substring T[sa[lo]:sa[lo] + d] occurs
hi - lo >= 2 times (at sa[lo:hi]) and is followed by at least two different characters (right-maximal).
"""
from __future__ import annotations

import numpy as np


def _rank_tables(codes: np.ndarray, depth: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """(suffix array by the first >= depth characters, {h: rank of each suffix's first h characters})."""
    n = len(codes)
    rank = np.unique(codes, return_inverse=True)[1].astype(np.int64).reshape(-1)
    sa = np.argsort(rank, kind="stable")
    ranks, h = {1: rank}, 1
    while h < depth:
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[:max(0, n - h)] = rank[h:]  # past the end: -1, below every character
        key = rank * (n + 2) + (nxt + 1)
        sa = np.argsort(key, kind="stable")
        ks = key[sa]
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = np.concatenate(([0], np.cumsum(ks[1:] != ks[:-1])))
        h *= 2
        ranks[h] = rank
    return sa, ranks


def _lcp(sa: np.ndarray, ranks: dict[int, np.ndarray], depth: int) -> np.ndarray:
    """min(depth, common prefix length) of each pair of neighbouring suffixes in `sa`."""
    n = len(sa)
    a, b = sa[:-1], sa[1:]
    lcp = np.zeros(n - 1, dtype=np.int64)
    pad = -1 - np.arange(2 * depth + 1, dtype=np.int64)  # past the end: distinct per position, so never equal
    for h in sorted(ranks, reverse=True):
        r = np.concatenate((ranks[h], pad))
        grow = (lcp + h <= depth) & (r[a + lcp] == r[b + lcp])
        lcp += h * grow
    return lcp


def repeats(codes: np.ndarray, max_len: int):
    """(sa, [(d, lo, hi)] for d in 2..max_len): every internal suffix-tree node of depth d, as intervals of sa."""
    if len(codes) < 2 or max_len < 2:
        return np.arange(len(codes)), []
    depth = max_len + 1
    sa, ranks = _rank_tables(codes, depth)
    lcp = _lcp(sa, ranks, depth)
    ext = np.append(lcp, 0)
    out = []
    for d in range(2, max_len + 1):
        edges = np.diff(np.concatenate(([0], (lcp >= d).view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs of lcp >= d: [s, e)
        if not len(starts):
            break
        idx = np.empty(2 * len(starts), dtype=np.int64)
        idx[0::2], idx[1::2] = starts, ends
        node = np.minimum.reduceat(ext, idx)[0::2] == d
        out.append((d, starts[node], ends[node] + 1))
    return sa, out
