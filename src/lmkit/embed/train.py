"""word2vec training: skip-gram and CBOW, with negative sampling and/or hierarchical softmax.

Skip-gram maximizes sum_t sum_{0<|j|<=b_t} log P(w_{t+j} | w_t) with P proportional to exp(u_{t+j}^T v_t),
the window b_t drawn uniformly from 1..window for each position. Negative sampling replaces log P by
log s(u_o^T v) + sum_{k} log s(-u_k^T v), k drawn from the noise P_n(w) ~ c_w^0.75 (s: the logistic);
hierarchical softmax by sum over the Huffman path of log s((1 - 2 code) u_node^T v). CBOW predicts w_t from
the mean of its window's input vectors. Stochastic gradient ascent, the rate decaying linearly from alpha to
min_alpha over all epochs, as gensim and word2vec.c do; here a batch of pairs is one vectorized step (reads
before writes within a batch, sums of the updates of a word that occurs several times in it).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from lmkit.embed.steps import Steps
from lmkit.embed.vectors import WordVectors
from lmkit.embed.vocab import Vocabulary, encode_corpus, huffman_paths
from lmkit.errors import ConfigError

CHUNK_WORDS = 10000  # the learning rate is set once per chunk of the corpus (gensim's job size)
NOISE_TABLE = 10_000_000  # word2vec.c's unigram table: drawing a noise word is one random index into it


@dataclass
class Word2VecConfig:
    dim: int = 100
    window: int = 5
    negative: int = 5
    hs: bool = False
    sg: bool = True
    min_count: int = 5
    sample: float = 1e-3
    epochs: int = 5
    alpha: float = 0.025
    min_alpha: float = 0.0001
    ns_exponent: float = 0.75
    seed: int = 1
    threads: int = 2
    batch_pairs: int = 1024  # skip-gram pairs per vectorized step (CBOW: see cbow_centers)
    compile: bool = True  # compile the batch step with inductor (falls back to eager without a compiler)

    def check(self) -> None:
        if self.dim < 1 or self.window < 1 or self.epochs < 1 or self.min_count < 1 or self.threads < 1:
            raise ConfigError("--dim, --window, --epochs, --min-count and --threads must all be at least 1")
        if self.negative < 0:
            raise ConfigError(f"--negative must be >= 0, got {self.negative}")
        if not self.hs and self.negative == 0:
            raise ConfigError("with --negative 0 give --hs: training needs negative sampling or hierarchical softmax")
        if self.sample < 0:
            raise ConfigError(f"--sample must be >= 0 (0: keep every word), got {self.sample}")


@dataclass
class TrainReport:
    words: int = 0  # in-vocabulary corpus words over all epochs, counted before subsampling
    seconds: float = 0.0

    @property
    def words_per_second(self) -> float:
        return self.words / self.seconds if self.seconds else 0.0


class _Output:
    """The output side: negative sampling (one row per word, the noise table) and/or hierarchical softmax
    (one row per inner node of the Huffman tree, each word's path)."""

    def __init__(self, cfg: Word2VecConfig, vocab: Vocabulary):
        V, d = len(vocab), cfg.dim
        self.negative = cfg.negative
        self.neg = self.noise = None
        if cfg.negative:
            self.neg = torch.zeros(V, d)
            cum = vocab.noise_cumulative(cfg.ns_exponent)
            size = min(NOISE_TABLE, max(1_000_000, 100 * V))
            self.noise = np.searchsorted(cum, (np.arange(size) + 0.5) / size).astype(np.int64)
        self.hs = self.points = self.codes = self.path_mask = None
        if cfg.hs:
            points, codes, lengths = huffman_paths(vocab.counts)
            self.points, self.codes = torch.from_numpy(points), torch.from_numpy(codes)
            self.path_mask = torch.arange(points.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
            self.hs = torch.zeros(V - 1, d)

    def arguments(self, target: torch.Tensor, rng: np.random.Generator) -> tuple:
        """(neg, rows, hs, points, codes, path_mask) for a batch: rows holds the target then k noise draws."""
        rows = None
        if self.neg is not None:
            noise = self.noise[rng.integers(0, len(self.noise), (len(target), self.negative))]
            rows = torch.cat((target[:, None], torch.from_numpy(noise)), dim=1)
        return self.neg, rows, self.hs, self.points, self.codes, self.path_mask


def _windows(n_total: int, start: int, end: int, sentence_of: np.ndarray, window: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(centers, contexts) positions of every pair in the chunk [start, end): context within the center's
    reduced window b ~ U{1..window} and in the same sentence."""
    centers = np.arange(start, end)
    reach = rng.integers(1, window + 1, end - start)
    cs, xs = [], []
    for offset in range(1, window + 1):
        near = reach >= offset
        for j in (centers - offset, centers + offset):
            ok = near & (j >= 0) & (j < n_total)
            ok[ok] &= sentence_of[j[ok]] == sentence_of[centers[ok]]
            cs.append(centers[ok])
            xs.append(j[ok])
    return np.concatenate(cs), np.concatenate(xs)


class Word2Vec:
    """Trains word vectors on tokenized sentences: `train` returns the input vectors as WordVectors.

    The corpus is read in chunks of CHUNK_WORDS words, subsampled, then cut into windows; a window does not
    reach across a sentence's end, nor across the end of a chunk."""

    def __init__(self, config: Word2VecConfig | None = None):
        self.config = config or Word2VecConfig()
        self.config.check()

    def train(self, sentences: Iterable[Sequence[str]], progress: Callable[[int, float], None] | None = None
              ) -> tuple[WordVectors, TrainReport]:
        """Vectors and a report (words seen, seconds). `threads` workers take chunks of the corpus in order and
        update the shared matrices without locks, as gensim's workers do (repeatable with one thread)."""
        cfg = self.config
        sentences = sentences if isinstance(sentences, list) else list(sentences)
        vocab = Vocabulary.build(sentences, cfg.min_count)
        ids, sentence_of = encode_corpus(sentences, vocab)
        rng = np.random.default_rng(cfg.seed)
        V, d = len(vocab), cfg.dim
        # word2vec.c's start: input vectors uniform in [-0.5, 0.5) / dim, output vectors zero
        W = torch.from_numpy((rng.random((V, d), dtype=np.float32) - 0.5) / d)
        output = _Output(cfg, vocab)
        keep = vocab.keep_probabilities(cfg.sample)
        total = len(ids) * cfg.epochs
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for epoch in range(cfg.epochs):
            for lo in range(0, len(ids), CHUNK_WORDS):
                jobs.put((epoch * len(ids) + lo, lo, min(lo + CHUNK_WORDS, len(ids))))
        errors: list[BaseException] = []
        done_words = [0]
        lock = threading.Lock()

        def work(worker: int) -> None:
            local = np.random.default_rng([cfg.seed, worker])
            try:
                while not errors:
                    try:
                        seen, lo, hi = jobs.get_nowait()
                    except queue.Empty:
                        return
                    lr = torch.tensor(max(cfg.min_alpha, cfg.alpha - (cfg.alpha - cfg.min_alpha) * seen / total))
                    chunk, sents = ids[lo:hi], sentence_of[lo:hi]
                    kept = local.random(len(chunk)) < keep[chunk]
                    self._train_chunk(W, output, steps, chunk[kept], sents[kept], lr, local)
                    with lock:
                        done_words[0] += hi - lo
                        if progress is not None:
                            progress(done_words[0], float(lr))
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # parallel over workers: intra-op threads on these small ops only contend
        try:
            steps = self._compiled_steps(W, output)  # compiled under the thread count it will run with
            start = time.perf_counter()
            if cfg.threads == 1:
                work(0)
            else:
                pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(cfg.threads)]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
            seconds = time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)
        if errors:
            raise errors[0]
        report = TrainReport(words=total, seconds=seconds)
        return WordVectors(vocab.words, W.numpy(), counts=vocab.counts), report

    def _compiled_steps(self, W: torch.Tensor, output: _Output) -> Steps:
        """The skip-gram step compiled for this run's batch shape (warmed with lr = 0, which changes nothing)."""
        cfg = self.config
        steps = Steps(cfg.compile)
        rng = np.random.default_rng(0)
        if cfg.sg:
            n = cfg.batch_pairs
            target = torch.zeros(n, dtype=torch.int64)
            steps.warm("skipgram", W, torch.zeros(n, dtype=torch.int64), target, None, *output.arguments(target, rng))
        # CBOW stays eager: inductor's loop for the window mean and its spread ran about half as fast as the
        # eager ops (bmm, index_add_) on 2 AVX-512 cores, at every batch size tried
        return steps

    def _train_chunk(self, W: torch.Tensor, output: _Output, steps: Steps, ids: np.ndarray,
                     sentence_of: np.ndarray, lr: torch.Tensor, rng: np.random.Generator) -> None:
        cfg = self.config
        centers, contexts = _windows(len(ids), 0, len(ids), sentence_of, cfg.window, rng)
        if not len(centers):
            return
        ids_t = torch.from_numpy(ids)
        if cfg.sg:  # the context word's input vector predicts the center word (gensim's order)
            inputs, targets = ids_t[torch.from_numpy(contexts)], ids_t[torch.from_numpy(centers)]
            neg, rows, *hs = output.arguments(targets, rng)  # the noise of the whole chunk in one draw
            for s in range(0, len(inputs), cfg.batch_pairs):
                e = s + cfg.batch_pairs
                steps("skipgram", W, inputs[s:e], targets[s:e], lr, neg, None if rows is None else rows[s:e], *hs)
            return
        table, mask, target_pos = _window_table(centers, contexts, 2 * cfg.window)
        context, targets = ids_t[torch.from_numpy(table)], ids_t[torch.from_numpy(target_pos)]
        mask_t = torch.from_numpy(mask)
        neg, rows, *hs = output.arguments(targets, rng)
        n = cbow_centers(cfg)
        for s in range(0, len(targets), n):
            e = s + n
            steps("cbow", W, context[s:e], mask_t[s:e], targets[s:e], lr, neg, None if rows is None else rows[s:e], *hs)


def cbow_centers(cfg: Word2VecConfig) -> int:
    """Centre words per CBOW step: about 4 batch_pairs context words (a window holds about `window` of them
    on average); measured on 2 cores, the eager step is fastest near 800 centres."""
    return max(1, 4 * cfg.batch_pairs // cfg.window)


def _window_table(centers: np.ndarray, contexts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(context positions (N, width), mask, center positions (N,)) grouping the pairs by center; padding
    points at position 0 and is masked out."""
    order = np.argsort(centers, kind="stable")
    centers, contexts = centers[order], contexts[order]
    uniq, first, count = np.unique(centers, return_index=True, return_counts=True)
    slot = np.arange(len(centers)) - np.repeat(first, count)
    row = np.repeat(np.arange(len(uniq)), count)
    table = np.zeros((len(uniq), width), dtype=np.int64)
    mask = np.zeros((len(uniq), width), dtype=bool)
    table[row, slot] = contexts
    mask[row, slot] = True
    return table, mask, uniq
