"""word2vec's per-pair SGD loop over one chunk of the corpus, compiled by numba (no GIL held).

For hidden vector h (skip-gram: the input vector v of a context word; CBOW: the mean of the window's
input vectors) predicting word o, with output rows u and learning rate lr:
negative sampling: for the target (label 1) and k noise draws n ~ P_n (label 0; a draw equal to o is
skipped), g = lr (label - s(u.h)), e += g u, then u += g h; hierarchical softmax: for each inner node on
o's Huffman path with code c, g = lr (1 - c - s(u.h)), skipped where |u.h| >= MAX_EXP, the same updates.
Finally the input side gets e: v += e (CBOW: every context word gets the whole e). Rows are updated in
place pair after pair, as in word2vec.c and gensim's word2vec_inner.pyx.

Randomness is splitmix64 (a 64-bit counter advanced by a fixed odd gamma, then mixed); the top 32 bits x
of each draw give subsampling (keep w when x / 2^32 < P(keep w)), the reduced window b = 1 + x mod window,
and the noise draws (Walker's alias table at r = x / 2^32). It replaces word2vec.c's 48-bit linear
congruential generator, whose top bits made runs with different seeds agree less with each other on small
corpora. One chunk is repeatable from its seed alone, whichever thread runs it.
"""
from __future__ import annotations

import math

import llvmlite.binding
import numpy as np
from numba import njit

# LLVM vectorizes a loop over d floats 4 registers at a time by default and leaves the rest (36 of d = 100
# on AVX-512) to scalar code; one register at a time leaves fewer than 16. The option is process-wide in
# LLVM and only changes how fast loops run, not what they compute.
llvmlite.binding.set_option("", "-force-vector-interleave=1")

MAX_EXP = 6.0  # word2vec.c's range of u.h for hierarchical softmax; outside it a node's step is skipped
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO32 = 4294967296.0


@njit(nogil=True, cache=True, inline="always")
def _bits(state):
    """The top 32 bits of splitmix64's output for this state."""
    z = (state ^ (state >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return (z ^ (z >> np.uint64(31))) >> np.uint64(32)


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _dot(a, i, b, j, d):
    """a[i] . b[j] in float32. The partial sums may be added in any order (as BLAS's sdot adds them), which
    is what lets the loop run in vector lanes; the rest of the kernel keeps IEEE order."""
    s = np.float32(0.0)
    for k in range(d):
        s += a[i, k] * b[j, k]
    return s


@njit(nogil=True, cache=True, inline="always")
def _axpy(g, x, i, y, j, d):
    """y[j] += g x[i]."""
    for k in range(d):
        y[j, k] += g * x[i, k]


@njit(nogil=True, cache=True, inline="always")
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@njit(nogil=True, cache=True, inline="always")
def _draw(keep, alias, r):
    """A noise word from Walker's alias table and r uniform in [0, 1): column j = floor(r V), kept when the
    rest r V - j < keep[j], else its alias."""
    x = r * keep.shape[0]
    j = min(np.int64(x), keep.shape[0] - 1)
    return j if x - j < keep[j] else alias[j]


@njit(nogil=True, cache=True, inline="always")
def _output_step(h, hrow, target, lr, neg, noise_keep, noise_alias, negative, hs, points, codes, lengths,
                 work, state):
    """Update the output rows for predicting `target` from h[hrow]; add the step for h into work[0]."""
    d = h.shape[1]
    if lengths.shape[0] > 0:
        for p in range(lengths[target]):
            node = points[target, p]
            f = _dot(h, hrow, hs, node, d)
            if f <= -MAX_EXP or f >= MAX_EXP:
                continue
            g = np.float32((1.0 - codes[target, p] - _sigmoid(f)) * lr)
            _axpy(g, hs, node, work, 0, d)
            _axpy(g, h, hrow, hs, node, d)
    if negative == 0:
        return state
    for n in range(negative + 1):
        if n == 0:
            row, label = target, 1.0
        else:
            state += _GAMMA
            row = _draw(noise_keep, noise_alias, np.float64(_bits(state)) / _TWO32)
            if row == target:
                continue
            label = 0.0
        g = np.float32((label - _sigmoid(_dot(h, hrow, neg, row, d))) * lr)
        _axpy(g, neg, row, work, 0, d)
        _axpy(g, h, hrow, neg, row, d)
    return state


@njit(nogil=True, cache=True)
def train_chunk(ids, sentence_of, keep, W, neg, noise_keep, noise_alias, negative, hs, points, codes, lengths,
                sg, window, lr, seed):
    """One chunk: subsample, draw each centre's window b ~ U{1..window} inside its sentence, and run the
    SGD step of every (context, centre) pair (skip-gram) or of every centre's window mean (CBOW).
    neg / noise_keep / noise_alias are (0, d) / (0,) / (0,) when negative sampling is off; hs / points /
    codes / lengths are (0, d) / (0, 0) / (0, 0) / (0,) when hierarchical softmax is off, so that every
    configuration calls the one compiled version. Returns how many words were kept."""
    d = W.shape[1]
    state = np.uint64(seed)
    kept = np.empty(ids.shape[0], dtype=np.int64)
    sent = np.empty(ids.shape[0], dtype=np.int64)
    n = 0
    for t in range(ids.shape[0]):
        state += _GAMMA
        r = np.float64(_bits(state)) / _TWO32
        if r < keep[ids[t]]:
            kept[n] = ids[t]
            sent[n] = sentence_of[t]
            n += 1
    work = np.zeros((1, d), dtype=np.float32)
    mean = np.zeros((1, d), dtype=np.float32)
    start = 0
    for i in range(n):
        if i == 0 or sent[i] != sent[i - 1]:
            start = i
        state += _GAMMA
        b = 1 + np.int64(_bits(state) % np.uint64(window))
        lo = max(start, i - b)
        hi = i + b + 1
        if hi > n:
            hi = n
        centre = kept[i]
        if sg:
            for j in range(lo, hi):
                if j == i or sent[j] != sent[i]:
                    continue
                word = kept[j]
                work[0, :] = 0.0  # the context word's input vector predicts the centre (word2vec.c's order)
                state = _output_step(W, word, centre, lr, neg, noise_keep, noise_alias, negative, hs, points,
                                     codes, lengths, work, state)
                _axpy(np.float32(1.0), work, 0, W, word, d)
        else:
            count = 0
            mean[0, :] = 0.0
            for j in range(lo, hi):
                if j == i or sent[j] != sent[i]:
                    continue
                count += 1
                _axpy(np.float32(1.0), W, kept[j], mean, 0, d)
            if count == 0:
                continue
            inv = np.float32(1.0 / count)
            for k in range(d):
                mean[0, k] *= inv
            work[0, :] = 0.0
            state = _output_step(mean, 0, centre, lr, neg, noise_keep, noise_alias, negative, hs, points,
                                 codes, lengths, work, state)
            for j in range(lo, hi):
                if j == i or sent[j] != sent[i]:
                    continue
                _axpy(np.float32(1.0), work, 0, W, kept[j], d)
    return n
