"""Truncation and padding of encoded sequences (only when asked), following HF `tokenizers`."""
from __future__ import annotations

from dataclasses import dataclass, field

from lmkit.errors import TokenizerError


@dataclass
class Encoding:
    """One encoded input: ids, token type ids (0 for A, 1 for B), attention mask (1 = real token) and
    special-tokens mask (1 = added by the post-processor or padding)."""

    ids: list[int]
    type_ids: list[int] = field(default_factory=list)
    attention_mask: list[int] = field(default_factory=list)
    special_tokens_mask: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


def truncate_pair(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Lengths kept by HF's "longest_first": cut the longer sequence first; when both must be cut they get
    budget // 2 each, the one that was longer (B on a tie) keeping the odd token."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    short, long_ = (n2, n1) if swap else (n1, n2)
    if short > budget:
        long_ = short
    else:
        long_ = max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if swap else (short, long_)


def truncate(a: list[int], b: list[int] | None, max_length: int, added: int) -> tuple[list[int], list[int] | None]:
    budget = max_length - added
    if budget < 0:
        raise TokenizerError(f"max_length={max_length} leaves no room for the {added} special tokens; raise max_length")
    if b is None:
        return a[:budget], None
    n1, n2 = truncate_pair(len(a), len(b), budget)
    return a[:n1], b[:n2]


def pad(encodings: list[Encoding], pad_id: int | None, length: int | None = None, multiple_of: int | None = None,
        side: str = "right", pad_type_id: int = 0) -> list[Encoding]:
    """Pad every encoding to `length` (default: the longest), rounded up to a multiple of `multiple_of`."""
    target = max((len(e) for e in encodings), default=0) if length is None else length
    if multiple_of:
        target = -(-target // multiple_of) * multiple_of
    if any(len(e) < target for e in encodings) and pad_id is None:
        raise TokenizerError("padding needs a pad token: train with a pad token in special_tokens, or set "
                             "tokenizer.pad_token_id")
    for e in encodings:
        n = target - len(e)
        if n <= 0:
            continue
        if side == "right":
            e.ids += [pad_id] * n
            e.type_ids += [pad_type_id] * n
            e.attention_mask += [0] * n
            e.special_tokens_mask += [1] * n
        else:
            e.ids[:0] = [pad_id] * n
            e.type_ids[:0] = [pad_type_id] * n
            e.attention_mask[:0] = [0] * n
            e.special_tokens_mask[:0] = [1] * n
    return encodings
