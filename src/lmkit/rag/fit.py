"""Fitting retrieved sources into a decoder's context: room = positions - answer tokens reserved.

Sources go in by rank; past the room they are dropped from the lowest rank first, and when even the best
source alone does not fit, its text is cut to the longest prefix (in the decoder's tokens) that does, if at
least MIN_SOURCE_TOKENS of it are left. A prompt left with no source is refused (`UngroundedError`) unless
the caller allows an ungrounded answer; every refusal names the room and what takes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from lmkit.errors import GenerationError
from lmkit.rag.retrieve import Hit

MIN_SOURCE_TOKENS = 16  # a shorter piece of a source grounds nothing and only crowds the answer
DEFAULT_ANSWER_TOKENS = 128


class UngroundedError(GenerationError):
    """No retrieved source fits the context beside the prompt and the answer, so the answer would be ungrounded."""


def default_answer_tokens(context: int) -> int:
    """The answer tokens reserved when none are asked for: 128, or a quarter of the context when that is less."""
    return max(1, min(DEFAULT_ANSWER_TOKENS, context // 4))


@dataclass
class Room:
    """The model's positions, the answer's reserved tokens, and the flag that sets them (named in messages)."""

    context: int
    answer: int
    answer_flag: str = "--max-new-tokens"

    @property
    def left(self) -> int:
        return self.context - self.answer

    def check(self) -> None:
        if self.answer < 1:
            raise GenerationError(f"{self.answer_flag} must be at least 1, got {self.answer}")
        if self.left < 1:
            raise GenerationError(
                f"{self.answer_flag} {self.answer} leaves no room for the prompt in the model's {self.context} "
                f"positions; give at most {default_answer_tokens(self.context)} (a quarter of the context) so that "
                "the question and the sources fit")


@dataclass
class Fitted:
    prompt: object
    ids: list[int]
    sources: list[Hit]
    notices: list[str] = field(default_factory=list)


def _cut(tokenizer, hit: Hit, n: int) -> Hit:
    ids = tokenizer.encode(hit.text, add_special_tokens=False)[:n]
    return replace(hit, text=tokenizer.decode(ids).replace("\ufffd", "").rstrip())


def _truncated(render, tokenizer, hit: Hit, room: int) -> tuple[Hit, object, list[int], int] | None:
    """The longest prefix of hit (at least MIN_SOURCE_TOKENS of its tokens) whose prompt fits in room, by
    bisection on the token count; None when even the shortest does not fit."""
    total = len(tokenizer.encode(hit.text, add_special_tokens=False))
    lo, hi, best = MIN_SOURCE_TOKENS, total - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cut = _cut(tokenizer, hit, mid)
        prompt, ids = render([cut])
        if len(ids) <= room:
            best, lo = (cut, prompt, ids, mid), mid + 1
        else:
            hi = mid - 1
    return None if best is None else (*best[:3], total)


def describe(bare: int, parts: dict[str, int], rest: str) -> str:
    """'N tokens (the question 9, the instruction 40, the template 12)': the prompt with no source, by part."""
    named = [f"{name} {n}" for name, n in parts.items()]
    named.append(f"{rest} {bare - sum(parts.values())}")
    return f"{bare} tokens ({', '.join(named)})"


def fit_sources(render: Callable[[list[Hit]], tuple[object, list[int]]], hits: Sequence[Hit], room: Room,
                tokenizer, parts: dict[str, int] | None = None, rest: str = "the template",
                allow_ungrounded: bool = False,
                ungrounded: Callable[[], tuple[object, list[int]]] | None = None) -> Fitted:
    """render(sources) -> (prompt, ids) with as many of the best hits as fit in room.left tokens.

    parts: the token counts of the named pieces of the prompt without sources (the question, the instruction,
    ...), the remainder called `rest`; both only word the messages. With no source left, UngroundedError, or
    with allow_ungrounded the prompt ungrounded() renders (render([]) by default) and a notice.
    """
    room.check()
    notices, kept = [], list(hits)
    prompt, ids = render(kept)
    while len(ids) > room.left and len(kept) > 1:
        dropped = kept.pop()
        notices.append(f"source {len(kept) + 1} ({dropped.source}) dropped: the prompt did not fit the model's "
                       f"context ({len(ids)} tokens for {room.left})")
        prompt, ids = render(kept)
    if kept and len(ids) <= room.left:
        return Fitted(prompt, ids, kept, notices)
    bare_prompt, bare_ids = render([])
    where = (f"the model has {room.context} positions, {room.answer} of them kept for the answer "
             f"({room.answer_flag}), leaving {room.left} for the prompt")
    if len(bare_ids) > room.left:
        reason = f"the prompt without any source takes {describe(len(bare_ids), parts or {}, rest)}, more than fits"
        if allow_ungrounded and ungrounded is not None:
            prompt, ids = ungrounded()
            if len(ids) <= room.left:
                return Fitted(prompt, ids, [], [f"{reason} ({room.left} tokens): the answer is ungrounded "
                                                "(no source, no instruction)"])
        raise GenerationError(f"{reason}: {where}; ask a shorter question, use a model with more context, or lower "
                              f"{room.answer_flag}")
    if kept:
        whole = len(ids)  # the prompt with the best source alone, uncut
        cut = _truncated(render, tokenizer, kept[0], room.left)
        if cut is not None:
            hit, prompt, ids, total = cut
            kept_tokens = len(tokenizer.encode(hit.text, add_special_tokens=False))
            notices.append(f"source 1 ({hit.source}) cut to its first {kept_tokens} of {total} tokens: the whole "
                           f"of it did not fit the model's context ({whole} tokens for {room.left})")
            return Fitted(prompt, ids, [hit], notices)
        sizes = ", ".join(str(len(render([h])[1]) - len(bare_ids)) for h in hits)
        reason = (f"no retrieved source fits beside the question: {where}; the prompt without sources takes "
                  f"{describe(len(bare_ids), parts or {}, rest)}, leaving {room.left - len(bare_ids)} tokens for "
                  f"sources (a source needs its header and {MIN_SOURCE_TOKENS} tokens of its text), and the "
                  f"{len(hits)} retrieved chunks take {sizes}")
        advice = (f"index with a smaller --chunk-tokens, use a model with more context, or lower "
                  f"{room.answer_flag}")
    else:
        reason, advice = "no chunk of the index matches the question", "rephrase it, or index documents about it"
    if not allow_ungrounded:
        raise UngroundedError(f"{reason}; {advice}")
    prompt, ids = ungrounded() if ungrounded is not None else (bare_prompt, bare_ids)
    # one notice: the reason names every chunk's size, which says more than a drop notice per source
    return Fitted(prompt, ids, [], [f"{reason}: the answer is ungrounded (no source)"])
