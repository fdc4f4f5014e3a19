"""Data mixtures: `--corpus pydocs:0.7,pycode:0.3` samples training rows from each source in proportion to its
weight. Every row has seq_len + 1 tokens, so sampling rows by weight samples tokens by weight. Each row's source is
drawn from (seed, step) alone, like the rows themselves: runs are repeatable and resume exactly, and the realised
mixture of any span of steps is known without having kept a count.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from lmkit.errors import CorpusError, TrainingError


@dataclass(frozen=True)
class Source:
    spec: str  # a built-in corpus name or a path, as --corpus takes it
    weight: float


def _weighted(spec: str) -> tuple[str, float] | None:
    name, sep, weight = spec.rpartition(":")
    if not sep or not name or os.path.exists(spec):
        return None
    try:
        value = float(weight)
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        raise CorpusError(f"the weight of {name!r} in --corpus must be a positive number, got {weight!r} "
                          "(e.g. pydocs:0.7,pycode:0.3)")
    return name, value


def parse_mixture(specs: Sequence[str]) -> list[Source] | None:
    """The weighted sources of --corpus (NAME:WEIGHT items, comma- or space-separated), normalised to sum to 1; None
    when no item carries a weight (plain concatenation)."""
    items = [part for spec in specs for part in str(spec).split(",") if part] if any(
        _weighted(part) for spec in specs for part in str(spec).split(",") if part) else list(specs)
    weighted = [_weighted(part) for part in items]
    if all(w is None for w in weighted):
        return None
    if any(w is None for w in weighted):
        plain = next(p for p, w in zip(items, weighted) if w is None)
        raise CorpusError(f"--corpus mixes weighted and unweighted sources ({plain!r}); give every source a weight, "
                          "e.g. pydocs:0.7,pycode:0.3")
    names = [name for name, _ in weighted]
    if len(set(names)) != len(names):
        raise CorpusError(f"--corpus names a source twice ({', '.join(names)}); give each once with its weight")
    total = sum(w for _, w in weighted)
    return [Source(name, w / total) for name, w in weighted]


def corpus_specs(specs: Sequence[str]) -> list[str]:
    """The sources --corpus reads, weights left out."""
    mixture = parse_mixture(specs)
    return list(specs) if mixture is None else [s.spec for s in mixture]


class MixedStream:
    """Training rows drawn from several packed streams (`PackedStream`) with the mixture's weights."""

    def __init__(self, streams: Sequence, sources: Sequence[Source]):
        if len(streams) != len(sources) or not streams:
            raise TrainingError("a mixture needs one stream per source")
        if len({s.seq_len for s in streams}) != 1:
            raise TrainingError("the streams of a mixture must share one sequence length")
        self.streams, self.sources = list(streams), list(sources)
        self.seq_len = streams[0].seq_len
        self.weights = torch.tensor([s.weight for s in sources], dtype=torch.float64)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.streams)

    def choices(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        """The source index of each row of step `step`: a function of (seed, step) only."""
        key = int.from_bytes(hashlib.sha256(f"mixture:{seed}:{step}".encode()).digest()[:8], "little") >> 1
        return torch.multinomial(self.weights, batch_size, replacement=True,
                                 generator=torch.Generator().manual_seed(key))

    def global_rows(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        which = self.choices(seed, step, batch_size)
        rows = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        for i, stream in enumerate(self.streams):
            picked = (which == i).nonzero().flatten()
            if len(picked):  # each source's rows come from its own stream's (seed, step) draw
                rows[picked] = stream.global_rows(seed * 1000 + i, step, len(picked))
        return rows

    def rows(self, seed: int, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        if batch_size % world_size:
            raise TrainingError(f"--batch-size {batch_size} is not divisible by the {world_size} processes; pick a multiple")
        per = batch_size // world_size
        return self.global_rows(seed, step, batch_size)[rank * per:(rank + 1) * per]

    def realised(self, seed: int, steps: int, batch_size: int) -> dict[str, float]:
        """The share of training tokens each source gave over steps [0, steps)."""
        counts = torch.zeros(len(self.sources))
        for step in range(steps):
            counts += torch.bincount(self.choices(seed, step, batch_size), minlength=len(self.sources))
        total = max(float(counts.sum()), 1.0)
        return {s.spec: float(c) / total for s, c in zip(self.sources, counts)}
