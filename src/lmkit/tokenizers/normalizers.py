"""Normalizers: str -> str maps applied before pre-tokenization (the `normalizer` of tokenizer.json).

Each class mirrors the component of the same name in Hugging Face `tokenizers`; `to_json` writes
the same JSON, `normalizer_from_json` reads it.
"""
from __future__ import annotations


import regex

from lmkit.errors import TokenizerError
from lmkit.tokenizers.chars import (LATIN1_TO_BYTELEVEL, has_regex_unknown, is_bert_mark, is_cjk, is_combining_mark,
                                    is_control, is_whitespace, lower_extra, normalize, onig_view)
from lmkit.tokenizers.precompiled import charsmap


class Normalizer:
    type_name = ""

    def normalize(self, text: str) -> str:
        raise NotImplementedError

    def drops_first(self, text: str) -> bool:
        """Whether normalizing removes the first character of `text` (then, in HF's alignments, the result no
        longer starts at the text's start, and Metaspace's prepend_scheme "first" does not prepend)."""
        return False

    def normalize_start(self, text: str) -> tuple[str, bool]:
        """The normalized text, and whether its first character still comes from the first one of `text`."""
        return self.normalize(text), not self.drops_first(text)

    def to_json(self) -> dict:
        return {"type": self.type_name}


class _UnicodeForm(Normalizer):
    form = ""

    def normalize(self, text: str) -> str:
        return normalize(self.form, text)


class NFC(_UnicodeForm):
    type_name = form = "NFC"


class NFD(_UnicodeForm):
    type_name = form = "NFD"


class NFKC(_UnicodeForm):
    type_name = form = "NFKC"


class NFKD(_UnicodeForm):
    type_name = form = "NFKD"


def lowercase(text: str) -> str:
    """Each character's full lowercase mapping on its own, as Rust's `char::to_lowercase`: Python's `str.lower`
    also applies the context rule Final_Sigma (word-final capital sigma to `ς`), which HF does not, and does not
    know the case pairs of recent Unicode versions, which Rust does."""
    return lower_extra(text.replace("\u03a3", "\u03c3").lower())


class Lowercase(Normalizer):
    type_name = "Lowercase"

    def normalize(self, text: str) -> str:
        return lowercase(text)


class _CharTable(dict):
    """A str.translate table that fills itself: translate runs in C, `rule` only sees each new character."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def __missing__(self, cp: int):
        out = self[cp] = self.rule(chr(cp))
        return out


_COMBINING_MARKS = _CharTable(lambda c: None if is_combining_mark(c) else c)


def strip_accents(text: str) -> str:
    """Drop every combining mark (categories Mn, Mc and Me, HF's `is_combining_mark`); the caller decomposes
    first (NFD) to expose them. BertNormalizer's strip_accents drops only Mn."""
    return text.translate(_COMBINING_MARKS)


class StripAccents(Normalizer):
    """Removes combining marks; pair it with NFD/NFKD as HF does, it does not decompose by itself."""

    type_name = "StripAccents"

    def normalize(self, text: str) -> str:
        return strip_accents(text) if not text.isascii() else text

    def drops_first(self, text: str) -> bool:
        return bool(text) and is_combining_mark(text[0])


class Strip(Normalizer):
    type_name = "Strip"

    def __init__(self, left: bool = True, right: bool = True):
        self.left, self.right = left, right

    def normalize(self, text: str) -> str:
        start, end = 0, len(text)
        while self.left and start < end and is_whitespace(text[start]):
            start += 1
        while self.right and end > start and is_whitespace(text[end - 1]):
            end -= 1
        return text[start:end]

    def drops_first(self, text: str) -> bool:
        return self.left and bool(text) and is_whitespace(text[0])

    def to_json(self) -> dict:
        return {"type": self.type_name, "strip_left": self.left, "strip_right": self.right}


# HF's regexes are Oniguruma's Ruby syntax, where ^ and $ match at every line start and end
ONIG_FLAGS = regex.MULTILINE


def regex_view(pattern: str):
    """What a compiled HF pattern should match on: the text as Oniguruma classifies it (`onig_view`), unless
    the pattern itself names a character Oniguruma does not know."""
    return (lambda text: text) if has_regex_unknown(pattern) else onig_view


def onig_spans(compiled: regex.Pattern, text: str) -> list[tuple[int, int]]:
    """(start, end) of each match as HF's Oniguruma `find_iter` yields them: every empty match is kept, but not
    one right where the previous match ended, and after an empty match the search moves on one character."""
    spans = [m.span() for m in compiled.finditer(text)]
    if all(s < e for s, e in spans):  # no empty match: Python's iteration is Oniguruma's
        return spans
    spans, pos, last = [], 0, None
    while pos <= len(text):
        m = compiled.search(text, pos)
        if m is None:
            break
        s, e = m.span()
        if s == e == last:
            pos += 1
            continue
        spans.append((s, e))
        pos = last = e
    return spans


def replacer(pattern: dict, content: str):
    """str -> str replacing every match of HF's pattern, {"String": literal} or {"Regex": expression}."""
    if not isinstance(pattern, dict) or not ({"String", "Regex"} & set(pattern)):
        raise TokenizerError(f"Replace pattern must be {{'String': ...}} or {{'Regex': ...}}, not {pattern!r}")
    if "String" in pattern:
        literal = pattern["String"]
        return lambda text: text.replace(literal, content) if text else text  # HF: nothing matches in ""
    try:
        compiled = regex.compile(pattern["Regex"], ONIG_FLAGS)
    except regex.error as exc:
        raise TokenizerError(f"Replace regex {pattern['Regex']!r} does not compile: {exc}") from exc
    view = regex_view(pattern["Regex"])

    def sub(text: str) -> str:
        out, prev = [], 0
        for s, e in onig_spans(compiled, view(text)):
            out += (text[prev:s], content)
            prev = e
        return "".join(out) + text[prev:] if out else text
    return lambda text: sub(text) if text else text


def matches_at_start(pattern: dict):
    """str -> bool: whether HF's pattern has a non-empty match at the start of the text."""
    if "String" in pattern:
        literal = pattern["String"]
        return lambda text: bool(literal) and text.startswith(literal)
    compiled, view = regex.compile(pattern["Regex"], ONIG_FLAGS), regex_view(pattern["Regex"])

    def at_start(text: str) -> bool:
        m = compiled.match(view(text))
        return m is not None and m.end() > 0
    return at_start


class Replace(Normalizer):
    """Replace every match of a literal string or a regex (HF `Replace`)."""

    type_name = "Replace"

    def __init__(self, pattern: dict, content: str):
        self.pattern, self.content = pattern, content
        self._replace = replacer(pattern, content)
        self._at_start = matches_at_start(pattern) if content == "" else None

    def normalize(self, text: str) -> str:
        return self._replace(text)

    def drops_first(self, text: str) -> bool:
        return self._at_start is not None and self._at_start(text)

    def to_json(self) -> dict:
        return {"type": self.type_name, "pattern": self.pattern, "content": self.content}


class Prepend(Normalizer):
    type_name = "Prepend"

    def __init__(self, prepend: str):
        self.prepend = prepend

    def normalize(self, text: str) -> str:
        return self.prepend + text if text else text

    def to_json(self) -> dict:
        return {"type": self.type_name, "prepend": self.prepend}


class ByteLevel(Normalizer):
    """GPT-2's byte-level map as a normalizer: UTF-8 bytes, each shown as one printable character."""

    type_name = "ByteLevel"

    def normalize(self, text: str) -> str:
        return text.encode("utf-8").decode("latin-1").translate(LATIN1_TO_BYTELEVEL)


_NMT_DROP = [*range(0x01, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F, 0x8F, 0x9F]
_NMT_SPACE = [0x09, 0x0A, 0x0C, 0x0D, 0x1680, *range(0x200B, 0x2010), 0x2028, 0x2029, 0x2581, 0xFEFF, 0xFFFD]


class Nmt(Normalizer):
    """SentencePiece's nmt_nfkc cleanup without the NFKC: drop control characters, map odd spaces to ' '."""

    type_name = "Nmt"
    _table = {**dict.fromkeys(_NMT_DROP), **dict.fromkeys(_NMT_SPACE, " ")}

    def normalize(self, text: str) -> str:
        return text.translate(self._table)

    def drops_first(self, text: str) -> bool:
        return bool(text) and self._table.get(ord(text[0]), text[0]) is None


class BertNormalizer(Normalizer):
    """BERT's cleanup: drop NUL, U+FFFD and control chars and map whitespace to ' ' (clean_text), put spaces
    around CJK ideographs, strip accents (NFD, drop Mn; by default when lowercasing), lowercase."""

    type_name = "BertNormalizer"

    def __init__(self, clean_text: bool = True, handle_chinese_chars: bool = True,
                 strip_accents: bool | None = None, lowercase: bool = True):
        self.clean_text = clean_text
        self.handle_chinese_chars = handle_chinese_chars
        self.strip_accents = strip_accents
        self.lowercase = lowercase
        self._table = _CharTable(self._char)
        self._marks = _CharTable(lambda c: None if is_bert_mark(c) else c)

    def _char(self, c: str) -> str:
        out = c
        if self.clean_text:
            if c == "\x00" or c == "\ufffd" or is_control(c):
                out = ""
            elif is_whitespace(c):
                out = " "
        if out and self.handle_chinese_chars and is_cjk(out):
            out = f" {out} "
        return out

    def drops_first(self, text: str) -> bool:
        if not text:
            return False
        if self.clean_text and self._char(text[0]) == "":
            return True
        do_strip = self.strip_accents if self.strip_accents is not None else self.lowercase
        return bool(do_strip) and is_bert_mark(normalize("NFD", text[0])[0])

    def normalize(self, text: str) -> str:
        if self.clean_text or self.handle_chinese_chars:
            if not (text.isascii() and text.isprintable()):
                text = text.translate(self._table)
        do_strip = self.strip_accents if self.strip_accents is not None else self.lowercase
        if do_strip and not text.isascii():
            text = normalize("NFD", text).translate(self._marks)
        if self.lowercase:
            text = lowercase(text)
        return text

    def to_json(self) -> dict:
        return {"type": self.type_name, "clean_text": self.clean_text, "handle_chinese_chars": self.handle_chinese_chars,
                "strip_accents": self.strip_accents, "lowercase": self.lowercase}


class Precompiled(Normalizer):
    """SentencePiece's compiled normalization rules (nmt_nfkc, nfkc_cf, a custom TSV...), as HF applies them;
    see `lmkit.tokenizers.precompiled`. The charsmap is parsed once per process. A removed first character still
    leaves the result starting at the text's start (HF gives the next character its alignment)."""

    type_name = "Precompiled"

    def __init__(self, precompiled_charsmap: str):
        self.precompiled_charsmap = precompiled_charsmap
        self._charsmap = charsmap(precompiled_charsmap)

    def normalize(self, text: str) -> str:
        return self._charsmap.normalize(text)

    def to_json(self) -> dict:
        return {"type": self.type_name, "precompiled_charsmap": self.precompiled_charsmap}


class Sequence(Normalizer):
    type_name = "Sequence"

    def __init__(self, normalizers: list[Normalizer]):
        self.normalizers = list(normalizers)

    def normalize(self, text: str) -> str:
        for n in self.normalizers:
            text = n.normalize(text)
        return text

    def normalize_start(self, text: str) -> tuple[str, bool]:
        kept = True
        for n in self.normalizers:
            text, k = n.normalize_start(text)
            kept = kept and k
        return text, kept

    def to_json(self) -> dict:
        return {"type": self.type_name, "normalizers": [n.to_json() for n in self.normalizers]}


def normalizer_from_json(d: dict | None) -> Normalizer | None:
    """Build a normalizer from its tokenizer.json object (None stays None)."""
    if d is None:
        return None
    kind = d.get("type")
    simple = {"NFC": NFC, "NFD": NFD, "NFKC": NFKC, "NFKD": NFKD, "Lowercase": Lowercase, "StripAccents": StripAccents,
              "ByteLevel": ByteLevel, "Nmt": Nmt}
    if kind in simple:
        return simple[kind]()
    if kind == "BertNormalizer":
        return BertNormalizer(d.get("clean_text", True), d.get("handle_chinese_chars", True),
                              d.get("strip_accents"), d.get("lowercase", True))
    if kind == "Sequence":
        return Sequence([normalizer_from_json(x) for x in d["normalizers"]])
    if kind == "Strip":
        return Strip(d.get("strip_left", True), d.get("strip_right", True))
    if kind == "Replace":
        return Replace(d["pattern"], d["content"])
    if kind == "Prepend":
        return Prepend(d["prepend"])
    if kind == "Precompiled":
        return Precompiled(d.get("precompiled_charsmap"))
    raise TokenizerError(f"unsupported normalizer type {kind!r} in tokenizer.json; lmkit reads NFC, NFD, NFKC, NFKD, "
                         "Lowercase, StripAccents, BertNormalizer, Strip, Replace, Prepend, ByteLevel, Nmt, "
                         "Precompiled and Sequence")
