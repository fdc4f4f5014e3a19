"""A completion's text as its tokens arrive: stop strings cut it (the stop itself is not returned, as in OpenAI's
API), and text that may still turn into a stop string, or an unfinished UTF-8 character, is held back until it
cannot, so a stream never shows what the final text will not hold."""
from __future__ import annotations


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop string (or are an unfinished character)."""
    held = 0
    while held < len(text) and text[len(text) - 1 - held] == "\ufffd":
        held += 1  # a byte-level token that ends inside a character decodes to U+FFFD until the rest arrives
    body = text[:len(text) - held]
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(body)), 0, -1):
            if body.endswith(stop[:k]):
                longest = max(longest, k)
                break
    return held + longest


class StopText:
    """Feed the growing list of output ids; `push` returns the new text safe to show.

    Decoding is incremental, as text-generation-inference does it: only the ids since the last clean cut are
    decoded, after a window of the ids before it, so that decoders which drop a leading space at the start of a
    text still join the pieces right."""

    def __init__(self, tokenizer, stops: list[str], special_ids: set[int], min_tokens: int = 0):
        """`min_tokens`: a stop string counts only where it ends past the text of the first min_tokens - 1 output
        tokens (vLLM's min_tokens, as the engine reads it)."""
        self.tokenizer, self.stops, self.special = tokenizer, stops, special_ids
        self.min_tokens, self.floor = min_tokens, (0 if min_tokens <= 1 else None)
        self.sent = 0  # characters of `text` already shown
        self.text = ""  # the text of the ids up to read_offset (then cut at a stop)
        self.prefix_offset = self.read_offset = 0
        self.seen = 0
        self.ids: list[int] = []  # the output without special tokens
        self.stopped = False

    def _extend(self, final: bool) -> str:
        """The decoded text of all ids, committing the clean part to self.text."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self.text
        return self.text + full[len(prefix):]  # an unfinished character: shown only if nothing more comes

    def push(self, ids: list[int], final: bool = False) -> str:
        """The text to add after `ids` (all output ids so far); with final, everything left."""
        if self.stopped:
            return ""
        self.ids.extend(i for i in ids[self.seen:] if i not in self.special)
        self.seen = len(ids)
        text = self._extend(final)
        if self.floor is None and self.seen >= self.min_tokens:
            self.floor = len(self.tokenizer.decode([i for i in ids[:self.min_tokens - 1] if i not in self.special]))
        found = [] if self.floor is None else [text.find(s, max(0, self.floor - len(s) + 1)) for s in self.stops]
        cuts = [c for c in found if c >= 0]
        if cuts:
            text, self.stopped, final = text[:min(cuts)], True, True
        if final:
            self.text = text
        safe = len(text) if final else len(text) - _held_back(text, self.stops)
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta
