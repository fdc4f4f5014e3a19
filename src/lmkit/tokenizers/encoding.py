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


STRATEGIES = {"longest_first": "longest_first", "only_first": "only_first", "only_second": "only_second",
              "LongestFirst": "longest_first", "OnlyFirst": "only_first", "OnlySecond": "only_second"}  # API / JSON


def side_of(direction, default: str = "right") -> str:
    """"left" or "right" from an API value or tokenizer.json's "Left"/"Right"."""
    side = str(direction or default).lower()
    if side not in ("left", "right"):
        raise TokenizerError(f"side must be 'left' or 'right', not {direction!r}")
    return side


def truncate(a: list[int], b: list[int] | None, max_length: int, added: int, strategy: str = "longest_first",
             side: str = "right") -> tuple[list[int], list[int] | None]:
    """Cut A (and B) so that they fit max_length - added, as HF's truncate_encodings: longest_first, or only_first /
    only_second, which cut that sequence alone; side "left" drops tokens from the start."""
    budget = max_length - added
    if budget < 0:
        raise TokenizerError(f"max_length={max_length} leaves no room for the {added} special tokens; raise max_length")
    n1, n2 = len(a), len(b or [])
    if n1 + n2 <= budget:
        return a, b
    if budget == 0:  # HF empties both, whatever the strategy
        return [], ([] if b is not None else None)
    strategy = STRATEGIES.get(strategy)
    if strategy is None:
        raise TokenizerError("truncation strategy must be longest_first, only_first or only_second")
    if b is None and strategy != "only_second":
        n1 = budget
    elif strategy == "longest_first":
        n1, n2 = truncate_pair(n1, n2, budget)
    else:
        if b is None:
            raise TokenizerError("truncation strategy only_second needs a pair; use longest_first for single texts")
        cut = n1 + n2 - budget
        if (n1 if strategy == "only_first" else n2) <= cut:
            raise TokenizerError(f"the sequence {strategy} truncates is too short to fit max_length={max_length}; "
                                 "use the longest_first strategy or raise max_length")
        n1, n2 = (n1 - cut, n2) if strategy == "only_first" else (n1, n2 - cut)

    def keep(seq, n):
        return seq[:n] if side == "right" else seq[len(seq) - n:]
    return keep(a, n1), (keep(b, n2) if b is not None else None)


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
