"""Where words begin, read from a tokenizer's pieces (for whole-word masking). No torch here.

A token begins a word when whitespace precedes it in the text: WordPiece pieces that do not carry the
continuation prefix (`##`), byte-level BPE pieces whose first byte is whitespace (`Ġ` is a space), and
Metaspace pieces that start with `▁`; a piece of whitespace alone opens the word after it, and a piece
that ends in whitespace after other text makes the next token begin a word. Special and added tokens stand alone. Punctuation glued to a BPE word ("end," ->
`end` `,`) stays in that word; WordPiece splits punctuation into its own words, as BERT's original
whole-word masking does.
"""
from __future__ import annotations

from typing import Any

from lmkit.tokenizers.chars import CHAR_TO_BYTE


def _surface(piece: str, byte_level: bool, metaspace: str | None) -> str:
    """The text a piece stands for, with its leading or trailing whitespace."""
    if metaspace:
        piece = piece.replace(metaspace, " ")
    if byte_level and all(c in CHAR_TO_BYTE for c in piece):
        return bytes(CHAR_TO_BYTE[c] for c in piece).decode("utf-8", errors="replace")
    return piece


def _parts(component: Any) -> list[Any]:
    """A pre-tokenizer or decoder and, for a Sequence, the components inside it."""
    if component is None:
        return []
    inner = getattr(component, "pretokenizers", None) or getattr(component, "decoders", None) or []
    return [component] + [p for x in inner for p in _parts(x)]


def word_boundaries(tokenizer: Any) -> tuple[list[bool], list[bool]]:
    """(begins, ends), one flag per id in range(vocab_size): the piece begins a word, the piece ends in
    whitespace (so the next token begins one). Ids without a piece count as words of their own."""
    model = tokenizer.model
    parts = [p for x in (tokenizer.pre_tokenizer, tokenizer.decoder) for p in _parts(x)]
    kinds = {type(p).__name__ for p in parts}
    prefix = getattr(model, "prefix", None) if type(model).__name__ == "WordPiece" else None
    metaspace = next((p.replacement for p in parts if type(p).__name__ == "Metaspace"), None)
    byte_level = "ByteLevel" in kinds
    added = set(getattr(tokenizer.added, "id_to_content", {}))
    n = tokenizer.vocab_size
    begins, ends = [True] * n, [True] * n
    for i in range(n):
        piece = tokenizer.id_to_token(i)
        if piece is None or i in added:
            continue
        if prefix:
            begins[i], ends[i] = not piece.startswith(prefix), False
            continue
        text = _surface(piece, byte_level, metaspace)
        # a piece of whitespace alone (`Ġ`, `▁`, a newline) opens the word that follows it
        begins[i], ends[i] = text[:1].isspace(), text[-1:].isspace() and not text.isspace()
    return begins, ends
