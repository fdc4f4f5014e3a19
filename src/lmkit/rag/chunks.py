"""Documents cut into overlapping chunks measured in the encoder's tokens.

A document is split into words (maximal runs of non-space characters, each with the spaces before it);
each word's length is the number of tokens the encoder's tokenizer gives it alone, without special tokens.
Chunk j holds the consecutive words whose lengths sum to at most `chunk_tokens`, and the next chunk
starts so that about `overlap` tokens of words are shared with it. A chunk's text is the document's own
characters from its first word to its last (line breaks and indentation kept), so a chunk is exactly what
the encoder embeds: chunk_tokens + the special tokens must fit the encoder's max_seq_length.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lmkit.errors import ConfigError

WORD = re.compile(r"\s*\S+")


@dataclass(frozen=True)
class Chunk:
    source: str   # the document id
    n: int        # its place in the document, from 0
    start: int    # character offsets of the chunk in the document's text
    end: int
    text: str


class TokenCounter:
    """Tokens per word by the tokenizer, with a cache (documentation repeats its words)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, words: list[str]) -> list[int]:
        new = list(dict.fromkeys(w for w in words if w not in self.cache))
        if new:
            for w, ids in zip(new, self.tokenizer.encode_batch(new, add_special_tokens=False, num_workers=1)):
                self.cache[w] = max(len(ids), 1)
        return [self.cache[w] for w in words]


def check_sizes(chunk_tokens: int, overlap: int, max_tokens: int) -> None:
    if chunk_tokens < 1 or chunk_tokens > max_tokens:
        raise ConfigError(f"--chunk-tokens must lie in 1..{max_tokens} (the encoder's max_seq_length less its "
                          f"special tokens), got {chunk_tokens}")
    if overlap < 0 or overlap >= chunk_tokens:
        raise ConfigError(f"--overlap must lie in 0..{chunk_tokens - 1} (less than --chunk-tokens), got {overlap}")


def chunk_document(doc_id: str, text: str, count: TokenCounter, chunk_tokens: int, overlap: int) -> list[Chunk]:
    """The chunks of one document (none when it is blank), in order."""
    spans = [(m.start(), m.end()) for m in WORD.finditer(text)]
    if not spans:
        return []
    # a word's own characters (no leading spaces) start where its non-space part does
    starts = [s + len(text[s:e]) - len(text[s:e].lstrip()) for s, e in spans]
    # the word with one leading space, the way it is met inside running text (matters to byte-level BPE)
    lengths = count([(" " if s > 0 else "") + text[b:e] for (s, e), b in zip(spans, starts)])
    chunks, first = [], 0
    while first < len(spans):
        last, total = first, lengths[first]
        while last + 1 < len(spans) and total + lengths[last + 1] <= chunk_tokens:
            last += 1
            total += lengths[last]
        chunks.append(Chunk(doc_id, len(chunks), starts[first], spans[last][1], text[starts[first]:spans[last][1]]))
        if last + 1 >= len(spans):
            break
        # step back from the end while the words kept for overlap stay within `overlap` tokens
        nxt, shared = last + 1, 0
        while nxt - 1 > first and shared + lengths[nxt - 1] <= overlap:
            nxt -= 1
            shared += lengths[nxt]
        first = nxt
    return chunks
