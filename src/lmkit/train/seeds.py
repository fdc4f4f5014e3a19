"""The seeds of a training run's random draws: each a function of (seed, what, rank, step), so a resumed run
draws what the uninterrupted one would have."""
from __future__ import annotations

import hashlib
from typing import Any


def seed_int(*parts: Any) -> int:
    """A 63-bit seed: the first 8 bytes of sha256("part:part:..."), little-endian, shifted right once."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def train_seed(seed: int, rank: int) -> int:
    """Seed of the RNG dropout draws from: rank 0 gets a one-process run's, every other rank its own (ranks
    seeded alike would drop the same units in their different rows)."""
    return seed_int("train", seed, rank) if rank else seed_int("train", seed)


def resume_seed(seed: int, rank: int, step: int) -> int:
    """Seed of rank `rank` (> 0) resumed at `step` from a run of another world size, whose saved RNG states
    do not name one per rank (every rank taking rank 0's would drop the same units in its different rows)."""
    return seed_int("train", seed, rank, step)
