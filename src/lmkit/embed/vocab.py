"""Words of a corpus for word2vec: tokenizing, the vocabulary, subsampling, the noise table, Huffman codes.

Subsampling (word2vec.c, gensim): with threshold count c_t = t * N over the N retained words, word w of
count c_w is kept with probability min(1, (sqrt(c_w / c_t) + 1) * c_t / c_w).
Noise for negative sampling: P_n(w) = c_w^0.75 / sum_v c_v^0.75, drawn in O(1) from Walker's alias table.
Hierarchical softmax: each word's path in the Huffman tree of the counts, as inner-node ids and 0/1 codes.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from lmkit.errors import ConfigError

WORD = re.compile(r"\w+(?:['’]\w+)*")
MAX_SENTENCE_WORDS = 10000  # gensim's and word2vec.c's cap on one training sentence


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of word characters (letters, digits, underscore; inner apostrophes kept)."""
    return WORD.findall(text.lower())


def sentences_of(texts: Iterable[str]) -> Iterator[list[str]]:
    """Each text's words, cut into sentences of at most MAX_SENTENCE_WORDS words."""
    for text in texts:
        words = tokenize(text)
        for s in range(0, len(words), MAX_SENTENCE_WORDS):
            yield words[s:s + MAX_SENTENCE_WORDS]


@dataclass
class Vocabulary:
    """Words kept by min_count, most frequent first, and their counts. Equal counts are in gensim's order (the
    word that first appears later comes first), so that the vocabulary, and hence the Huffman tree, are gensim's."""

    words: list[str]
    counts: np.ndarray  # int64 (V,)

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], min_count: int = 5) -> "Vocabulary":
        counts: dict[str, int] = {}
        for sentence in sentences:
            for w in sentence:
                counts[w] = counts.get(w, 0) + 1
        kept = [(w, c) for w, c in counts.items() if c >= min_count]
        kept.reverse()
        kept.sort(key=lambda wc: -wc[1])  # stable on the reversed list: gensim's lexsort((-first, -count))
        if not kept:
            raise ConfigError(f"no word occurs at least --min-count {min_count} times; lower --min-count or give more text")
        return cls([w for w, _ in kept], np.array([c for _, c in kept], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.words)

    def index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}

    def keep_probabilities(self, sample: float) -> np.ndarray:
        """P(keep w) = min(1, (sqrt(c_w / (t N)) + 1) (t N) / c_w); all ones when sample is 0."""
        if sample <= 0:
            return np.ones(len(self), dtype=np.float64)
        threshold = sample * float(self.counts.sum())
        c = self.counts.astype(np.float64)
        return np.minimum(1.0, (np.sqrt(c / threshold) + 1) * threshold / c)

    def noise_cumulative(self, exponent: float = 0.75) -> np.ndarray:
        """Cumulative distribution of c_w^exponent, normalized to end at 1."""
        weights = self.counts.astype(np.float64) ** exponent
        cum = np.cumsum(weights)
        return cum / cum[-1]

    def noise_alias(self, exponent: float = 0.75) -> tuple[np.ndarray, np.ndarray]:
        """Walker's alias table of P_n (Vose's construction): with column j uniform in 0..V-1 and u uniform
        in [0, 1), the draw is j when u < keep[j], else alias[j]. Two reads from tables of V entries, which
        stay in cache where a unigram table of 10^6+ entries or a bisection does not."""
        weights = self.counts.astype(np.float64) ** exponent
        scaled = weights * (len(weights) / weights.sum())
        keep = np.ones(len(weights))
        alias = np.arange(len(weights), dtype=np.int64)
        small = [int(j) for j in np.flatnonzero(scaled < 1.0)]
        large = [int(j) for j in np.flatnonzero(scaled >= 1.0)]
        scaled = scaled.tolist()
        while small and large:
            j, big = small.pop(), large[-1]
            keep[j], alias[j] = scaled[j], big
            scaled[big] -= 1.0 - scaled[j]
            if scaled[big] < 1.0:
                small.append(large.pop())
        return keep, alias  # columns left over (rounding) keep themselves with probability 1


def encode_corpus(sentences: Iterable[Sequence[str]], vocab: Vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """(ids, sentence number) of every in-vocabulary word, words outside the vocabulary dropped."""
    index = vocab.index()
    ids: list[int] = []
    lengths: list[int] = []
    for sentence in sentences:
        row = [index[w] for w in sentence if w in index]
        ids.extend(row)
        lengths.append(len(row))
    sentence_of = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return np.asarray(ids, dtype=np.int64), sentence_of


class _Weight:
    """A Huffman tree node on the heap, compared by count alone (as gensim's Heapitem is)."""

    __slots__ = ("count", "node")

    def __init__(self, count: int, node: int):
        self.count, self.node = count, node

    def __lt__(self, other: "_Weight") -> bool:
        return self.count < other.count


def huffman_paths(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points, codes, lengths): for word w, points[w, :lengths[w]] are the inner nodes from the root down
    (ids 0..V-2) and codes[w, :lengths[w]] the branch taken at each (1 for the heavier child's side, as
    word2vec.c and gensim label it). Equal counts are ordered as gensim's heap orders them, so that the same
    counts give gensim's tree. Padding beyond a word's length is 0."""
    V = len(counts)
    if V < 2:
        raise ConfigError("hierarchical softmax needs at least two words in the vocabulary; lower --min-count")
    heap = [_Weight(int(c), i) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    parent = np.zeros(2 * V - 1, dtype=np.int64)
    branch = np.zeros(2 * V - 1, dtype=np.int8)
    node = V
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        parent[a.node], parent[b.node] = node, node
        branch[b.node] = 1
        heapq.heappush(heap, _Weight(a.count + b.count, node))
        node += 1
    root = node - 1
    paths = []
    for w in range(V):
        points, codes, n = [], [], w
        while n != root:
            codes.append(int(branch[n]))
            n = int(parent[n])
            points.append(n - V)
        paths.append((points[::-1], codes[::-1]))
    longest = max(len(p) for p, _ in paths)
    P = np.zeros((V, longest), dtype=np.int64)
    C = np.zeros((V, longest), dtype=np.float32)
    L = np.zeros(V, dtype=np.int64)
    for w, (p, c) in enumerate(paths):
        P[w, :len(p)], C[w, :len(c)], L[w] = p, c, len(p)
    return P, C, L
