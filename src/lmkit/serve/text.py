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
    """Feed the growing list of output ids; `push` returns the new text safe to show."""

    def __init__(self, tokenizer, stops: list[str], special_ids: set[int]):
        self.tokenizer, self.stops, self.special = tokenizer, stops, special_ids
        self.sent = 0
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.special])

    def push(self, ids: list[int], final: bool = False) -> str:
        """The text to add after `ids` (all output ids so far); with final, everything left."""
        if self.stopped:
            return ""
        text = self._decode(ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            text, self.stopped, final = text[:min(cuts)], True, True
        safe = len(text) if final else len(text) - _held_back(text, self.stops)
        self.text = text
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta
