"""The lattices of every training word at once, as numpy arrays, for Unigram training.

Words lie end to end in one index space (word w covers positions start[w] .. end[w] - 1); an edge is one
occurrence of a piece, (pos, len, pid). Edges are kept sorted by (offset in the word, pos, len), so all edges
that start at the same offset form one level, and within a level no two edges share a start and an end in
the same word. Each pass is then a loop over levels (the longest word's length), vectorized inside:

    forward   A(j) = logsumexp over edges (i -> j) of A(i) + s        (A = 0 at a word's start)
    backward  B(i) = logsumexp over edges (i -> j) of s + B(j)        (B = 0 at a word's end)
    posterior of an edge = count * exp(A(i) + s + B(j) - Z),  Z = A(end)
    Viterbi   best(j) = max over edges (i -> j) of best(i) + s, the earliest start winning ties,
              which is the predecessor Hugging Face's lattice picks (strict >, nodes in insertion order).
"""
from __future__ import annotations

import numpy as np


class WordLattices:
    def __init__(self, start: np.ndarray, end: np.ndarray, count: np.ndarray, size: int,
                 pos: np.ndarray, length: np.ndarray, pid: np.ndarray):
        self.start, self.end, self.count = start, end, count.astype(np.float64)
        self.size = size  # positions 0 .. size (word ends included)
        word_of = np.full(size + 1, -1, dtype=np.int64)
        for_w = np.repeat(np.arange(len(start)), end - start)
        word_of[_ranges(start, end)] = for_w
        off = pos - start[word_of[pos]]
        order = np.lexsort((length, pos, off))
        del off
        self.pos = pos[order]
        small = np.int32  # all but the positions: half the memory (6M edges for a 4 MB corpus)
        self.len, self.pid = length[order].astype(small), pid[order].astype(small)
        self.word = word_of[self.pos].astype(small)
        self._off = (self.pos - start[self.word]).astype(small)
        self._levels()

    def _levels(self):
        self.end_pos = self.pos + self.len
        top = int(self._off[-1]) + 1 if len(self._off) else 0
        self.bounds = np.searchsorted(self._off, np.arange(top + 1))

    def keep(self, mask: np.ndarray):
        """Drop the edges where mask is False (their pieces left the vocabulary)."""
        self.pos, self.len, self.pid = self.pos[mask], self.len[mask], self.pid[mask]
        self.word, self._off = self.word[mask], self._off[mask]
        self._levels()

    def _slices(self, reverse=False):
        b = self.bounds
        rng = range(len(b) - 2, -1, -1) if reverse else range(len(b) - 1)
        for o in rng:
            if b[o] < b[o + 1]:
                yield slice(int(b[o]), int(b[o + 1]))

    def marginals(self, score: np.ndarray) -> np.ndarray:
        """count * posterior probability of each edge (forward-backward in log space), given edge scores."""
        pos, end = self.pos, self.end_pos
        a = np.full(self.size + 1, -np.inf)
        a[self.start] = 0.0
        for sl in self._slices():
            t = end[sl]
            a[t] = np.logaddexp(a[t], a[pos[sl]] + score[sl])
        b = np.full(self.size + 1, -np.inf)
        b[self.end] = 0.0
        for sl in self._slices(reverse=True):
            v = score[sl] + b[end[sl]]
            p = pos[sl]
            first = np.flatnonzero(np.concatenate(([True], p[1:] != p[:-1])))  # edges from one start, together
            m = np.maximum.reduceat(v, first)
            s = np.add.reduceat(np.exp(v - np.repeat(m, np.diff(np.append(first, len(v))))), first)
            b[p[first]] = m + np.log(s)
        z = a[self.end]
        return self.count[self.word] * np.exp(a[pos] + score + b[end] - z[self.word])

    def viterbi(self, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(edge, word) of every node on each word's best path."""
        pos, end = self.pos, self.end_pos
        best = np.full(self.size + 1, -np.inf)
        best[self.start] = 0.0
        back = np.full(self.size + 1, -1, dtype=np.int64)
        for sl in self._slices():
            t = end[sl]
            v = best[pos[sl]] + score[sl]
            better = v > best[t]
            best[t[better]] = v[better]
            back[t[better]] = sl.start + np.flatnonzero(better)
        edges, words = [], []
        w = np.flatnonzero(self.end > self.start)
        cur = self.end[w]
        while len(w):
            e = back[cur]
            edges.append(e)
            words.append(w)
            cur = pos[e]
            more = cur > self.start[w]
            w, cur = w[more], cur[more]
        if not edges:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(edges), np.concatenate(words)

    def second_best(self, at: np.ndarray, n: np.ndarray, score: np.ndarray):
        """For windows [at, at + n) (one occurrence of each piece): the best path through the window that does
        not use the edge spanning all of it. Returns (its score, [(edge, window)] of its nodes, left to right)."""
        order = np.lexsort((self.len, self.pos))
        sp = self.pos[order]
        first = np.searchsorted(sp, np.arange(self.size + 2))
        k = len(at)
        width = int(n.max()) if k else 0
        best = np.full((k, width + 1), -np.inf)
        best[:, 0] = 0.0
        back = np.full((k, width + 1), -1, dtype=np.int64)
        for o in range(width):
            rows = np.flatnonzero(n > o)
            p = at[rows] + o
            cnt = first[p + 1] - first[p]
            rows = np.repeat(rows, cnt)
            idx = order[np.repeat(first[p] - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum())]
            ln = self.len[idx]
            ok = (o + ln <= n[rows]) & ((o > 0) | (ln < n[rows]))
            rows, idx, tgt = rows[ok], idx[ok], o + ln[ok]
            v = best[rows, o] + score[idx]
            better = v > best[rows, tgt]
            best[rows[better], tgt[better]] = v[better]
            back[rows[better], tgt[better]] = idx[better]
        edges, wins = [], []
        w = np.arange(k)
        cur = n.copy()
        while len(w):
            e = back[w, cur]
            edges.append(e)
            wins.append(w)
            cur = cur - self.len[e]
            more = cur > 0
            w, cur = w[more], cur[more]
        # reversed: each window's nodes left to right, the order `tokenizers` sums over them
        flat_e = np.concatenate(edges)[::-1] if edges else np.zeros(0, dtype=np.int64)
        flat_w = np.concatenate(wins)[::-1] if wins else np.zeros(0, dtype=np.int64)
        return best[np.arange(k), n], flat_e, flat_w


def _ranges(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for each (s, e)."""
    lens = end - start
    return np.repeat(start - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
