"""SentencePiece's compiled normalization rules (`precompiled_charsmap`), read and applied as HF `tokenizers`
does (its `Precompiled` normalizer, crate `spm_precompiled`).

The charsmap is `u32 trie_size | trie: trie_size/4 little-endian u32 units | replacements`: a darts-clone
double-array trie over UTF-8 keys whose leaf values are byte offsets into the replacements blob, each
replacement ending at the next NUL. Normalizing cuts the text into extended grapheme clusters; a cluster of
fewer than 6 UTF-8 bytes that begins with a key becomes the replacement of its *shortest* such key, whole
(so `Ａ` + a combining accent loses the accent, as in HF); otherwise each character is replaced by its own
key's replacement or kept.
"""
from __future__ import annotations

import base64
import binascii
import re
import struct
from functools import lru_cache

from lmkit.errors import TokenizerError
from lmkit.tokenizers.chars import GRAPHEME

_CACHE_LIMIT = 100_000
_MAX_WHOLE = 6  # clusters of this many UTF-8 bytes or more are looked up character by character


def _bad(why: str) -> TokenizerError:
    return TokenizerError(f"Precompiled normalizer: precompiled_charsmap {why}; copy it again from the original "
                          "tokenizer.json or SentencePiece model")


def _offset(unit: int) -> int:
    """A darts-clone unit packs has_leaf (bit 8), the label (bits 0-7; bit 31 marks a value unit), the offset
    to the children (bits 10-31, shifted 8 more when bit 9 is set) and, in value units, the value (bits 0-30)."""
    return (unit >> 10) << ((unit & 0x200) >> 6)


def _utf8_length(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


class Charsmap:
    """A parsed precompiled_charsmap; `normalize(text)` applies it."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise _bad("is shorter than its 4-byte header")
        (size,) = struct.unpack_from("<I", blob)
        count = size // 4
        if count == 0 or len(blob) < 4 + 4 * count:
            raise _bad(f"announces a {size}-byte trie but holds {len(blob) - 4} bytes")
        self.units = struct.unpack_from(f"<{count}I", blob, 4)
        self.normalized = blob[4 + 4 * count:]
        try:
            self.normalized.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("has replacement strings that are not UTF-8") from None
        self._clusters = _Clusters(self)
        self._replacements: dict[int, str] = {}
        firsts = self._first_chars()
        # a text with no character that starts a key is left as it is (checked in C)
        self._touches = (re.compile("[" + "".join(map(re.escape, sorted(firsts))) + "]").search if firsts
                         else (lambda text: firsts is None))

    def _first_chars(self) -> set[str] | None:
        """Every character some key starts with (None if a key ends inside a character). The child of the node
        with children offset `b` by byte `c` is the unit at `b ^ c` when its label is `c`, so grouping units by
        `position ^ label` lists all children in one pass."""
        units = self.units
        children: dict[int, list[tuple[int, int]]] = {}
        for pos, unit in enumerate(units):
            label = unit & 0x800000FF
            if 0 < label < 256:
                children.setdefault(pos ^ label, []).append((label, pos))
        out = set()
        stack = [(b"", _offset(units[0]))]
        while stack:
            key, base = stack.pop()
            for label, pos in children.get(base, ()):
                child = key + bytes((label,))
                if len(child) == _utf8_length(child[0]):
                    try:
                        out.add(child.decode("utf-8"))
                    except UnicodeDecodeError:
                        pass  # no text holds these bytes
                    continue
                if (units[pos] >> 8) & 1:
                    return None
                stack.append((child, pos ^ _offset(units[pos])))
        return out

    def shortest(self, piece: bytes) -> str | None:
        """Replacement of the shortest key that starts `piece` (the trie walk stops at a NUL byte), or None."""
        units, n = self.units, len(self.units)
        node = _offset(units[0])
        for c in piece:
            if c == 0:
                return None
            node ^= c
            if node >= n:
                return None
            unit = units[node]
            if unit & 0x800000FF != c:
                return None
            node ^= _offset(unit)
            if (unit >> 8) & 1:
                if node >= n:
                    raise _bad("points outside its trie")
                return self._replacement(units[node] & 0x7FFFFFFF)
        return None

    def _replacement(self, start: int) -> str:
        out = self._replacements.get(start)
        if out is None:
            blob = self.normalized
            if start > len(blob):
                raise _bad("points past its replacement strings")
            end = blob.find(b"\0", start)
            try:
                out = self._replacements[start] = blob[start:len(blob) if end < 0 else end].decode("utf-8")
            except UnicodeDecodeError:
                raise _bad("points into the middle of a character") from None
        return out

    def cluster(self, cluster: str) -> str:
        """One grapheme cluster normalized: whole if short and a key starts it, else character by character."""
        raw = cluster.encode("utf-8")
        out = self.shortest(raw) if len(raw) < _MAX_WHOLE else None
        if out is None:
            out = "".join(c if (r := self.shortest(c.encode("utf-8"))) is None else r for c in cluster)
        return out

    def normalize(self, text: str) -> str:
        if not self._touches(text):
            return text
        return "".join(map(self._clusters.__getitem__, GRAPHEME.findall(text)))


class _Clusters(dict):
    """cluster -> normalized cluster, filled on first sight, so the map over known clusters runs in C."""

    def __init__(self, charsmap: Charsmap):
        super().__init__()
        self.charsmap = charsmap

    def __missing__(self, cluster: str) -> str:
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        out = self[cluster] = self.charsmap.cluster(cluster)
        return out


def charsmap(encoded: str) -> Charsmap:
    """The parsed charsmap of a tokenizer.json's base64 string, parsed once per process."""
    if not isinstance(encoded, str):
        raise _bad(f"must be a base64 string, not {type(encoded).__name__}")
    return _parse(encoded)


@lru_cache(maxsize=16)
def _parse(encoded: str) -> Charsmap:
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("is not valid base64") from None
    return Charsmap(blob)
