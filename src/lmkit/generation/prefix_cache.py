"""Automatic prefix caching for the serving engine, as vLLM's block hashes do it.

The keys and values of a sequence's first n * BLOCK tokens depend on those tokens only (causal attention), so a
request whose prompt begins with a block sequence some earlier request computed takes those blocks' keys and values
instead of prefilling them. Block i is keyed by its whole prefix: key_i = hash((key_{i-1}, tokens of block i)),
key_{-1} = hash(namespace) (the LoRA adapter, whose keys and values differ from the base model's); an entry keeps
its parent key and tokens, so that a hash collision is never taken for a match. Blocks are kept least-recently-used
first under a byte budget, a chain's deeper blocks before its shallower ones, so eviction takes leaves first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from lmkit.errors import GenerationError
from lmkit.generation.slots import SlotCache

BLOCK = 16  # tokens a block: vLLM's default block size


@dataclass
class _Entry:
    parent: int
    tokens: tuple[int, ...]
    kv: torch.Tensor  # (layers, 2, kv heads, BLOCK, head dim)


def token_bytes(model) -> int:
    """Bytes of one token's keys and values over every layer: layers * 2 * kv_heads * head_dim * element size."""
    config = model.config
    size = next(model.parameters()).element_size()
    return config.n_layers * 2 * config.resolved_n_kv_heads * config.resolved_head_dim * size


class PrefixCache:
    """Key/value blocks of earlier sequences keyed by token prefix, at most `budget` bytes of them (LRU)."""

    def __init__(self, model, budget: int):
        per_request = token_bytes(model) * model.config.max_seq_len
        if budget < per_request:
            raise GenerationError(
                f"a prefix cache of {budget / 2 ** 20:.1f} MiB cannot hold one request of this model's context "
                f"({model.config.max_seq_len} tokens: {per_request / 2 ** 20:.1f} MiB of keys and values); give at "
                f"least that much (--cache-memory), or 0 to turn prefix caching off")
        self.budget, self.used = budget, 0
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.queried = self.hits = 0  # prompt tokens looked up, and of them found (prefix_cache_hit_rate)

    def _chain(self, tokens: list[int], namespace, blocks: int) -> list[int]:
        keys, key = [], hash(("lmkit-prefix", namespace))
        for i in range(blocks):
            key = hash((key, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            keys.append(key)
        return keys

    def _found(self, key: int, parent: int, tokens: list[int], i: int) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.parent == parent and entry.tokens == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # the root ends most recent: eviction takes a chain's leaves first
            self.entries.move_to_end(key)

    def load(self, cache: SlotCache, slot: int, tokens: list[int], namespace=None) -> int:
        """Write the longest cached prefix of `tokens` into `slot`, leaving at least the last token to compute (its
        logits choose the first new token); returns its length (a multiple of BLOCK)."""
        blocks = (len(tokens) - 1) // BLOCK
        keys = self._chain(tokens, namespace, blocks)
        found, parent = 0, hash(("lmkit-prefix", namespace))
        for i, key in enumerate(keys):
            if not self._found(key, parent, tokens, i):
                break
            found, parent = i + 1, key
        self.queried += len(tokens)
        if not found:
            return 0
        self._touch(keys[:found])
        kv = torch.cat([self.entries[key].kv for key in keys[:found]], dim=3)
        cache.write(slot, 0, kv)
        self.hits += found * BLOCK
        return found * BLOCK

    def store(self, cache: SlotCache, slot: int, tokens: list[int], namespace=None) -> None:
        """Keep the full blocks of `slot`'s first cache.lengths[slot] positions (which hold `tokens`' keys and values)
        that are not cached yet, evicting least-recently-used blocks past the budget."""
        blocks = min(cache.lengths[slot], len(tokens)) // BLOCK
        keys = self._chain(tokens, namespace, blocks)
        parent = hash(("lmkit-prefix", namespace))
        new = []
        for i, key in enumerate(keys):
            if not self._found(key, parent, tokens, i):
                if key in self.entries:  # a collision: the other prefix keeps its block, this chain stops here
                    keys = keys[:i]
                    break
                new.append(i)
            parent = key
        if new:
            kv = cache.read(slot, new[0] * BLOCK, (new[-1] + 1) * BLOCK)
            for i in new:
                block = kv[:, :, :, (i - new[0]) * BLOCK:(i - new[0] + 1) * BLOCK].clone()
                self.entries[keys[i]] = _Entry(keys[i - 1] if i else hash(("lmkit-prefix", namespace)),
                                               tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), block)
                self.used += block.numel() * block.element_size()
        self._touch(keys)
        while self.used > self.budget and self.entries:
            _, entry = self.entries.popitem(last=False)
            self.used -= entry.kv.numel() * entry.kv.element_size()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queried if self.queried else 0.0
