"""Character classes shared by normalizers and pre-tokenizers, defined as the Rust `tokenizers` crate does.

Python's `str.isspace` also counts U+001C..U+001F as space; Unicode's White_Space property (what Rust's
`char::is_whitespace` tests) does not, so the set is spelled out here.
"""
from __future__ import annotations

import unicodedata

WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
WHITESPACE_CLASS = "[" + "".join(f"\\u{ord(c):04x}" for c in sorted(WHITESPACE)) + "]"

_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def is_whitespace(c: str) -> bool:
    """Unicode White_Space."""
    return c in WHITESPACE


def is_control(c: str) -> bool:
    """BERT's control class: categories Cc, Cf, Cs, Co except tab, newline and carriage return. Unassigned
    code points (Cn) are kept, as HF does: Python's Unicode tables may predate characters HF knows."""
    if c in "\t\n\r":
        return False
    cat = unicodedata.category(c)
    return cat[0] == "C" and cat != "Cn"


def is_punctuation(c: str) -> bool:
    """BERT's punctuation: ASCII punctuation (which includes symbols like `$` and `+`) or Unicode category P*."""
    return c in _ASCII_PUNCT or unicodedata.category(c)[0] == "P"


def is_cjk(c: str) -> bool:
    """The CJK Unified Ideographs blocks BERT pads with spaces (not Hiragana, Katakana or Hangul)."""
    cp = ord(c)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes map to themselves; the other 68 map to U+0100 upward, in byte order.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table from a latin-1 decoded byte string to the byte-level alphabet
LATIN1_TO_BYTELEVEL = {b: c for b, c in BYTE_TO_CHAR.items()}
