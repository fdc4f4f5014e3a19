"""Word vectors: cosine neighbours, analogies by 3CosAdd, similarity; saved as safetensors + JSON and as
the word2vec text format.

cos(a, b) = a.b / (|a| |b|). most_similar ranks every word w by cos(v_w, m) with m the unit mean of the
weighted unit vectors of the query (+1 for positive, -1 for negative words) and leaves the query words
out; the analogy a : b :: c : ? (3CosAdd) is argmax_w cos(v_w, v_b - v_a + v_c) on unit vectors, that is
most_similar(positive=[b, c], negative=[a]). Ranking, ties and scores follow gensim's KeyedVectors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from lmkit.atomic import atomic_open, atomic_save_file, atomic_write_json
from lmkit.errors import ConfigError

VECTORS_FILE, VOCAB_FILE, TEXT_FILE = "vectors.safetensors", "vocab.json", "vectors.txt"


def top_indices(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest scores, largest first (an argpartition then a sort of those n, so that
    equal scores come out in the order gensim's matutils.argsort gives them)."""
    n = min(n, scores.size)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    neg = -scores
    if n >= scores.size:
        return np.argsort(neg)[:n]
    best = np.argpartition(neg, n)[:n]
    return best.take(np.argsort(neg.take(best)))


class WordVectors:
    """Words (most frequent first), their vectors (V, d) float32 and, when trained here, their counts."""

    def __init__(self, words: Sequence[str], vectors: np.ndarray, counts: np.ndarray | None = None):
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(words):
            raise ConfigError(f"{len(words)} words need a ({len(words)}, dim) matrix, got shape {vectors.shape}")
        self.words = list(words)
        self.vectors = vectors
        self.counts = None if counts is None else np.asarray(counts, dtype=np.int64)
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ConfigError("the vocabulary lists a word twice; every word needs exactly one vector")
        self._norms: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def __getitem__(self, word: str) -> np.ndarray:
        return self.vectors[self._id(word)]

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    @property
    def norms(self) -> np.ndarray:
        if self._norms is None:
            self._norms = np.linalg.norm(self.vectors, axis=1)
        return self._norms

    def _id(self, word: str) -> int:
        try:
            return self.index[word]
        except KeyError:
            raise KeyError(f"word {word!r} is not in the vocabulary") from None

    def unit(self, word: str) -> np.ndarray:
        i = self._id(word)
        return self.vectors[i] / self.norms[i]

    def similarity(self, a: str, b: str) -> float:
        """cos(v_a, v_b)."""
        u, v = self[a], self[b]
        return float(np.dot(u / np.linalg.norm(u), v / np.linalg.norm(v)))

    def query_vector(self, positive: Sequence, negative: Sequence = ()) -> np.ndarray:
        """Unit mean of +-unit vectors of the words (or raw vectors) in `positive` and `negative`;
        a (word, weight) pair sets its own weight."""
        items = [(p, 1.0) for p in positive] + [(n, -1.0) for n in negative]
        mean = np.zeros(self.dim, dtype=np.float32)
        total = np.float64(0.0)
        for item, weight in items:
            if isinstance(item, tuple):
                item, weight = item
            weight = np.float64(weight)
            mean += weight * (np.asarray(item, dtype=np.float32) if isinstance(item, np.ndarray) else self.unit(item))
            total += abs(weight)
        if not items:
            raise ConfigError("most_similar needs at least one positive or negative word")
        if total > 0:
            mean = mean / total
        length = np.sqrt(np.dot(mean, mean))
        return (mean / length).astype(np.float32) if length > 0 else mean.astype(np.float32)

    def most_similar(self, positive: str | Sequence = (), negative: str | Sequence = (), topn: int = 10,
                     restrict_vocab: int | None = None) -> list[tuple[str, float]]:
        """The topn words w by cos(v_w, m), m the query vector; query words themselves left out."""
        positive = [positive] if isinstance(positive, (str, np.ndarray)) else list(positive)
        negative = [negative] if isinstance(negative, (str, np.ndarray)) else list(negative)
        if topn < 1:
            return []
        mean = self.query_vector(positive, negative)
        keys = [k[0] if isinstance(k, tuple) else k for k in positive + negative]
        asked = {self.index[k] for k in keys if isinstance(k, str) and k in self.index}
        end = restrict_vocab or len(self)
        scores = np.dot(self.vectors[:end], mean) / self.norms[:end]
        best = top_indices(scores, topn + len(asked))
        return [(self.words[i], float(scores[i])) for i in best if i not in asked][:topn]

    def analogy(self, a: str, b: str, c: str, topn: int = 1) -> list[tuple[str, float]]:
        """a : b :: c : ?  by 3CosAdd: argmax_w cos(v_w, v_b - v_a + v_c) over unit vectors, a, b, c left out."""
        return self.most_similar(positive=[b, c], negative=[a], topn=topn)

    # files ---------------------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike) -> None:
        """folder/vectors.safetensors (`vectors`), vocab.json (words, counts) and vectors.txt (word2vec text)."""
        from safetensors.numpy import save_file


        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_save_file(folder / VECTORS_FILE, lambda p: save_file({"vectors": self.vectors}, p))
        vocab = {"words": self.words, "dim": self.dim}
        if self.counts is not None:
            vocab["counts"] = self.counts.tolist()
        atomic_write_json(folder / VOCAB_FILE, vocab)
        self.save_word2vec_text(folder / TEXT_FILE)

    def save_word2vec_text(self, path: str | os.PathLike) -> None:
        """`V d` then `word x_1 ... x_d` per line, each float with 9 significant digits (exact for float32)."""

        bad = next((w for w in self.words if not w or any(ch.isspace() for ch in w)), None)
        if bad is not None:
            raise ConfigError(f"word {bad!r} is empty or holds whitespace, which the word2vec text format cannot store")
        with atomic_open(path, "w", encoding="utf-8") as f:
            f.write(f"{len(self)} {self.dim}\n")
            for word, row in zip(self.words, self.vectors):
                f.write(word + " " + " ".join(f"{x:.9g}" for x in row.tolist()) + "\n")

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "WordVectors":
        """Vectors saved by `save` (safetensors + vocab.json), or a word2vec text file or a folder holding one."""
        path = Path(folder)
        if path.is_file():
            return cls.load_word2vec_text(path)
        if (path / VECTORS_FILE).is_file() and (path / VOCAB_FILE).is_file():
            from safetensors.numpy import load_file

            vocab = json.loads((path / VOCAB_FILE).read_text(encoding="utf-8"))
            return cls(vocab["words"], load_file(str(path / VECTORS_FILE))["vectors"], vocab.get("counts"))
        if (path / TEXT_FILE).is_file():
            return cls.load_word2vec_text(path / TEXT_FILE)
        raise ConfigError(f"{folder} holds no word vectors; pass the --out folder of `lmkit embed train` "
                          "(vectors.safetensors + vocab.json) or a word2vec text file")

    @classmethod
    def load_word2vec_text(cls, path: str | os.PathLike) -> "WordVectors":
        """A word2vec text file (`COUNT DIM`, then one `word x_1 ... x_DIM` line per word), read as UTF-8."""
        try:
            return cls._read_word2vec_text(path)
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}); give a word2vec text file in UTF-8, "
                              "not the binary format (gensim: save_word2vec_format(..., binary=False))") from None

    @classmethod
    def _read_word2vec_text(cls, path: str | os.PathLike) -> "WordVectors":
        with open(path, encoding="utf-8") as f:
            header = f.readline().split()
            if len(header) != 2 or not all(h.isdigit() for h in header):
                raise ConfigError(f"{path} does not start with the word2vec header `COUNT DIM`; give a word2vec text file")
            n, d = int(header[0]), int(header[1])
            words, rows = [], np.zeros((n, d), dtype=np.float32)
            for i in range(n):
                parts = f.readline().rstrip().split(" ")
                if len(parts) != d + 1:
                    raise ConfigError(f"{path} line {i + 2} has {len(parts) - 1} numbers, not {d}; the file is damaged")
                words.append(parts[0])
                try:
                    rows[i] = np.asarray(parts[1:], dtype=np.float32)
                except ValueError:
                    raise ConfigError(f"{path} line {i + 2} holds a value that is not a number; the file is damaged") from None
        return cls(words, rows)
