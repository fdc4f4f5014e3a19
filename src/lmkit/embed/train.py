"""word2vec training: skip-gram and CBOW, with negative sampling and/or hierarchical softmax.

Skip-gram maximizes sum_t sum_{0<|j|<=b_t} log P(w_{t+j} | w_t) with P proportional to exp(u_{t+j}^T v_t),
the window b_t drawn uniformly from 1..window for each position. Negative sampling replaces log P by
log s(u_o^T v) + sum_{k} log s(-u_k^T v), k drawn from the noise P_n(w) ~ c_w^0.75 (s: the logistic);
hierarchical softmax by sum over the Huffman path of log s((1 - 2 code) u_node^T v). CBOW predicts w_t from
the mean of its window's input vectors. Stochastic gradient ascent one pair at a time (lmkit.embed.kernel),
the rate decaying linearly from alpha to min_alpha over all epochs, as gensim and word2vec.c do.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from lmkit.embed.vectors import WordVectors
from lmkit.embed.vocab import Vocabulary, encode_corpus, huffman_paths
from lmkit.errors import ConfigError

CHUNK_WORDS = 10000  # the learning rate is set once per chunk of the corpus (gensim's job size)
SEED_BITS = (1 << 63) - 1  # an int64, so that every seed gives the kernel the same argument types


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
    """The output side as the kernel takes it: negative sampling (one row per word, the alias table of the
    noise) and hierarchical softmax (one row per inner node of the Huffman tree, each word's path).
    The side that is off is a set of empty arrays of the same types, so that one compiled kernel serves
    every configuration."""

    def __init__(self, cfg: Word2VecConfig, vocab: Vocabulary):
        V, d = len(vocab), cfg.dim
        self.negative = int(cfg.negative)
        self.neg = np.zeros((V if cfg.negative else 0, d), dtype=np.float32)
        self.noise = vocab.noise_alias(cfg.ns_exponent) if cfg.negative else (np.zeros(0), np.zeros(0, np.int64))
        self.hs = np.zeros((V - 1 if cfg.hs else 0, d), dtype=np.float32)
        if cfg.hs:
            self.points, self.codes, self.lengths = huffman_paths(vocab.counts)
        else:
            self.points, self.codes, self.lengths = (np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32),
                                                     np.zeros(0, np.int64))

    def arguments(self) -> tuple:
        return self.neg, *self.noise, self.negative, self.hs, self.points, self.codes, self.lengths


def chunk_seed(seed: int, job: int) -> int:
    """The generator's start for job `job` (chunk and epoch) of a run seeded with `seed`."""
    return int(np.random.SeedSequence([seed, job]).generate_state(1, np.uint64)[0]) & SEED_BITS


class Word2Vec:
    """Trains word vectors on tokenized sentences: `train` returns the input vectors as WordVectors.

    The corpus is read in chunks of CHUNK_WORDS words, subsampled, then cut into windows; a window does not
    reach across a sentence's end, nor across the end of a chunk."""

    def __init__(self, config: Word2VecConfig | None = None):
        self.config = config or Word2VecConfig()
        self.config.check()

    def train(self, sentences: Iterable[Sequence[str]], progress: Callable[[int, int, float], None] | None = None
              ) -> tuple[WordVectors, TrainReport]:
        """Vectors and a report (words seen, seconds). `threads` workers take chunks of the corpus in order and
        update the shared matrices without locks, as gensim's workers do. Each chunk draws its randomness from
        its own seed, so one thread repeats itself exactly. progress(words done, words in all epochs, lr) is
        called after each chunk."""
        try:
            from lmkit.embed.kernel import train_chunk
        except ImportError as err:
            raise ConfigError(f"word2vec training needs numba ({err}): pip install numba") from None
        cfg = self.config
        sentences = sentences if isinstance(sentences, list) else list(sentences)
        vocab = Vocabulary.build(sentences, cfg.min_count)
        ids, sentence_of = encode_corpus(sentences, vocab)
        rng = np.random.default_rng(cfg.seed)
        V, d = len(vocab), cfg.dim
        # word2vec.c's start: input vectors uniform in [-0.5, 0.5) / dim, output vectors zero
        W = (rng.random((V, d), dtype=np.float32) - 0.5) / d
        output = _Output(cfg, vocab).arguments()
        keep = vocab.keep_probabilities(cfg.sample)
        total = len(ids) * cfg.epochs
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for epoch in range(cfg.epochs):
            for lo in range(0, len(ids), CHUNK_WORDS):
                jobs.put((epoch * len(ids) + lo, lo, min(lo + CHUNK_WORDS, len(ids))))
        errors: list[BaseException] = []
        done_words = [0]
        lock = threading.Lock()

        def run(lo: int, hi: int, lr: float, seed: int) -> None:
            train_chunk(ids[lo:hi], sentence_of[lo:hi], keep, W, *output, bool(cfg.sg), int(cfg.window), float(lr), seed)

        def work() -> None:
            try:
                while not errors:
                    try:
                        seen, lo, hi = jobs.get_nowait()
                    except queue.Empty:
                        return
                    lr = max(cfg.min_alpha, cfg.alpha - (cfg.alpha - cfg.min_alpha) * seen / total)
                    run(lo, hi, lr, chunk_seed(cfg.seed, seen))
                    with lock:
                        done_words[0] += hi - lo
                        if progress is not None:
                            progress(done_words[0], total, lr)
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)

        run(0, 0, 0.0, 0)  # compiles the kernel, or loads it from numba's cache, before the clock starts
        start = time.perf_counter()
        if cfg.threads == 1:
            work()
        else:
            pool = [threading.Thread(target=work, daemon=True) for _ in range(cfg.threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        report = TrainReport(words=total, seconds=seconds)
        return WordVectors(vocab.words, W, counts=vocab.counts), report
