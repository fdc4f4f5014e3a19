"""The serving engine's KV cache: one slot per running request, and the views a model's forward writes through.

`SlotCache` holds keys and values (slots, H, capacity, D) per layer; `PrefillView` is what one slot's forward over
a chunk of its prompt sees, `DecodeView` what one decoding step over several slots (one new token each, at each
slot's own length) sees. Both have the `get_seq_length` / `update` interface of `lmkit.nn.KVCache`.
"""
from __future__ import annotations

import torch


class SlotCache:
    """Keys and values (slots, H, capacity, D) per layer; slot s holds lengths[s] positions. Capacity grows by
    doubling, as KVCache's does; buffers start at zero so that masked positions never carry NaN into attention."""

    def __init__(self, slots: int):
        self.slots = slots
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths = [0] * slots

    def copy(self, source: int, target: int) -> None:
        """Give slot `target` the keys and values of slot `source`."""
        length = self.lengths[source]
        for layer, keys in self.keys.items():
            keys[target, :, :length] = keys[source, :, :length]
            self.values[layer][target, :, :length] = self.values[layer][source, :, :length]
        self.lengths[target] = length

    def reorder(self, targets: list[int], sources: list[int]) -> None:
        """Give each slot of `targets` the keys and values slot sources[i] held (beam search's parents; all at
        one length), as one copy per layer."""
        length = self.lengths[sources[0]]
        targets_t, sources_t = torch.tensor(targets), torch.tensor(sources)
        for layer, keys in self.keys.items():
            keys[targets_t, :, :length] = keys[sources_t, :, :length]
            self.values[layer][targets_t, :, :length] = self.values[layer][sources_t, :, :length]

    def compact(self, running: list, free: list[int], *others: SlotCache) -> None:
        """Move the `running` requests (objects with a `.slot`) in the highest slots into the lowest of the `free`
        ones (sorted; updated), their keys and values copied (in `others` too: caches kept by the same slots), so
        that a step's rows stay consecutive slots, which attention reads as one view instead of gathering them at
        every step (a copy when a request leaves early)."""
        for request in sorted(running, key=lambda r: r.slot, reverse=True):
            if not free or free[0] > request.slot:
                return
            target = free.pop(0)
            for cache in (self, *others):
                cache.copy(request.slot, target)
            free.append(request.slot)
            free.sort()
            request.slot = target

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Slot `slot`'s keys and values of positions start..end-1: (layers, 2, H, end - start, D)."""
        return torch.stack([torch.stack((self.keys[layer][slot, :, start:end], self.values[layer][slot, :, start:end]))
                            for layer in sorted(self.keys)])

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """Put `kv` (layers, 2, H, T, D), as `read` returns it, at positions start..start+T-1 of `slot`."""
        end = start + kv.shape[3]
        for layer in range(kv.shape[0]):
            keys, values = self.buffers(layer, kv[layer, :1], end)
            keys[slot, :, start:end] = kv[layer, 0]
            values[slot, :, start:end] = kv[layer, 1]
        self.lengths[slot] = end

    def buffers(self, layer: int, like: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys.get(layer)
        if keys is None or keys.shape[2] < needed:
            old = 0 if keys is None else keys.shape[2]
            capacity = max(needed, 2 * old, 64)
            grown = [like.new_zeros(self.slots, like.shape[1], capacity, like.shape[3]) for _ in range(2)]
            if old:
                grown[0][:, :, :old] = keys
                grown[1][:, :, :old] = self.values[layer]
            self.keys[layer], self.values[layer] = grown
        return self.keys[layer], self.values[layer]


class PrefillView:
    """The cache as one slot's forward over a chunk of its prompt sees it."""

    def __init__(self, cache: SlotCache, slot: int):
        self.cache, self.slot, self.past, self.cross = cache, slot, cache.lengths[slot], {}

    def get_seq_length(self, layer: int = 0) -> int:
        return self.past

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.past + k.shape[2]
        keys, values = self.cache.buffers(layer, k, end)
        keys[self.slot, :, self.past:end] = k[0]
        values[self.slot, :, self.past:end] = v[0]
        return keys[self.slot:self.slot + 1, :, :end], values[self.slot:self.slot + 1, :, :end]


class DecodeView:
    """The cache as one decoding step over the rows `slots` (one new token each, at each slot's length) sees it:
    keys 0..max length, of which row i may attend to 0..lengths[i] (the mask `allowed`); with sliding `windows`,
    `allowed` is a dict {window (None: full attention): mask}, a layer sliding over W seeing lengths[i] - W < j
    only, as the model's sliding mask has it."""

    def __init__(self, cache: SlotCache, slots: list[int], device: torch.device, windows: set = frozenset()):
        self.cache, self.cross = cache, {}
        self.rows = torch.tensor(slots, device=device)
        self.lengths = torch.tensor([cache.lengths[s] for s in slots], device=device)
        self.past = max(cache.lengths[s] for s in slots)
        self.span = slice(slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) \
            else None  # consecutive slots are read as a view instead of gathered
        keys = torch.arange(self.past + 1, device=device)[None]
        self.allowed = (keys <= self.lengths[:, None])[:, None, None]
        if windows:
            self.allowed = {None: self.allowed, **{w: self.allowed & (keys > self.lengths[:, None] - w)[:, None, None]
                                                   for w in windows if w is not None}}
        self._flat: dict[tuple[int, int], torch.Tensor] = {}  # (heads, capacity) -> where the new keys go

    def get_seq_length(self, layer: int = 0) -> int:
        return self.past

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.buffers(layer, k, self.past + 1)
        heads, capacity, dim = keys.shape[1:]
        index = self._flat.get((heads, capacity))
        if index is None:  # row (slot, head, length) of the buffers seen as (slots * heads * capacity, dim)
            index = self._flat[heads, capacity] = ((self.rows[:, None] * heads + torch.arange(
                heads, device=self.rows.device)) * capacity + self.lengths[:, None]).reshape(-1)
        keys.view(-1, dim).index_copy_(0, index, k.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, index, v.reshape(-1, dim))
        end = self.past + 1
        if self.span is not None:
            start, rows = self.span.start, self.span.stop - self.span.start
            return keys.narrow(0, start, rows).narrow(2, 0, end), values.narrow(0, start, rows).narrow(2, 0, end)
        return keys[:, :, :end].index_select(0, self.rows), values[:, :, :end].index_select(0, self.rows)


class BatchPrefillView:
    """The cache as one forward over prompt chunks of several slots sees it, laid out as generate's left-padded
    batch: row b's chunk of c_b tokens continues slot b at start s_b, left-padded to the widest chunk C, and its
    keys 0..s_b + c_b end at the right edge of K = max(s_b + c_b, C) keys (`mask` marks them), so that causal
    attention over the past K - C keys lets each query see exactly its own slot's keys up to itself."""

    def __init__(self, cache: SlotCache, slots: list[int], starts: list[int], lengths: list[int]):
        self.cache, self.slots, self.starts, self.lengths, self.cross = cache, slots, starts, lengths, {}
        self.ends = [s + c for s, c in zip(starts, lengths)]
        self.width = max(lengths)
        self.total = max(max(self.ends), self.width)

    def get_seq_length(self, layer: int = 0) -> int:
        return self.total - self.width

    def mask(self, device: torch.device) -> torch.Tensor:
        """(B, K): 1 at each row's keys, 0 at the padding before them."""
        return (torch.arange(self.total, device=device)[None]
                >= torch.tensor([self.total - e for e in self.ends], device=device)[:, None]).long()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.buffers(layer, k, max(self.ends))
        out_k = k.new_zeros(k.shape[0], k.shape[1], self.total, k.shape[3])
        out_v = torch.zeros_like(out_k)
        for row, (slot, start, end, length) in enumerate(zip(self.slots, self.starts, self.ends, self.lengths)):
            keys[slot, :, start:end] = k[row, :, self.width - length:]
            values[slot, :, start:end] = v[row, :, self.width - length:]
            out_k[row, :, self.total - end:] = keys[slot, :, :end]
            out_v[row, :, self.total - end:] = values[slot, :, :end]
        return out_k, out_v


def prefill_logits(model, cache: SlotCache, rows: list[tuple[int, list[int], int]], keep_all: bool) -> torch.Tensor:
    """One forward over prompt chunks (slot, tokens, start) written into their slots: one chunk as it is, several
    left-padded as generate's batches are (`BatchPrefillView`; the padding's keys are masked, its outputs dropped).
    The logits (rows, T or 1, V) of every position (`keep_all`) or of each chunk's last token."""
    device = next(model.parameters()).device
    if len(rows) == 1:
        slot, tokens, start = rows[0]
        view, mask = PrefillView(cache, slot), None
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
    else:
        width = max(len(tokens) for _, tokens, _ in rows)
        view = BatchPrefillView(cache, [r[0] for r in rows], [r[2] for r in rows], [len(r[1]) for r in rows])
        mask = view.mask(device)
        ids = torch.tensor([[0] * (width - len(t)) + t for _, t, _ in rows], device=device)
        positions = torch.tensor([[0] * (width - len(t)) + list(range(s, s + len(t))) for _, t, s in rows],
                                 device=device)
    out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=view, use_cache=True,
                logits_to_keep=0 if keep_all else 1)
    return out.logits.float()
