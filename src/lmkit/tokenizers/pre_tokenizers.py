"""Pre-tokenizers: split normalized text into words, each of which the model encodes on its own.

`split(text, first)` returns the words of one stretch of text; `first` says whether the stretch starts the
input (Metaspace's prepend_scheme "first" needs it). Behaviour follows Hugging Face `tokenizers`.
"""
from __future__ import annotations

import regex

from lmkit.errors import TokenizerError
from lmkit.tokenizers.chars import (BYTE_TO_CHAR, SCRIPTS, WHITESPACE_CLASS, is_numeric, is_punctuation,
                                    is_whitespace, onig_view)
from lmkit.tokenizers.normalizers import ONIG_FLAGS, onig_spans, regex_view

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# the same language with the contractions factored (tiktoken's spelling), which `regex` matches faster
GPT2_FAST = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT4_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
_BYTE_TABLE = {b: c for b, c in BYTE_TO_CHAR.items()}
_WHITESPACE_RE = regex.compile(WHITESPACE_CLASS + "+")
BEHAVIORS = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")
# code (GPT-NeoX/StarCoder's whitespace tokens): a run of two or more spaces or tabs is a piece of its own, so
# indentation is learned as whole tokens instead of gluing onto the newline before it or the word after it
CODE_WHITESPACE = r"[ \t]{2,}"


def byte_level(piece: str) -> str:
    """Map a string to GPT-2's printable byte alphabet: UTF-8 bytes, each shown as one character."""
    return piece.encode("utf-8").decode("latin-1").translate(_BYTE_TABLE)


def split_spans(text: str, spans: list[tuple[int, int, bool]], behavior: str) -> list[str]:
    """Apply a HF SplitDelimiterBehavior to a cover of `text` by (start, end, is_match) spans."""
    out: list[list[int]] = []
    if behavior == "Removed":
        return [text[s:e] for s, e, m in spans if not m and e > s]
    if behavior == "Isolated":
        return [text[s:e] for s, e, _ in spans if e > s]
    if behavior == "Contiguous":
        prev = None
        for s, e, m in spans:
            if out and m == prev:
                out[-1][1] = e
            else:
                out.append([s, e])
            prev = m
    elif behavior == "MergedWithPrevious":
        prev = False
        for s, e, m in spans:
            if m and not prev and out:
                out[-1][1] = e
            else:
                out.append([s, e])
            prev = m
    elif behavior == "MergedWithNext":
        prev = False
        for s, e, m in reversed(spans):
            if m and not prev and out:
                out[-1][0] = s
            else:
                out.append([s, e])
            prev = m
        out.reverse()
    else:
        raise TokenizerError(f"unknown split behavior {behavior!r}; use one of {', '.join(BEHAVIORS)}")
    return [text[s:e] for s, e in out if e > s]


def match_spans(pattern: regex.Pattern, text: str, invert: bool = False) -> list[tuple[int, int, bool]]:
    """A cover of `text` by (start, end, is_match) spans, as HF's find_matches: an empty match is a span of its
    own, which splits the text there and takes part in the merging behaviours."""
    spans, prev = [], 0
    for s, e in onig_spans(pattern, text):
        if s > prev:
            spans.append((prev, s, invert))
        spans.append((s, e, not invert))
        prev = e
    if prev < len(text):
        spans.append((prev, len(text), invert))
    return spans


class PreTokenizer:
    type_name = ""

    def split(self, text: str, first: bool = True) -> list[str]:
        raise NotImplementedError

    def starts_at_start(self, text: str, word: str) -> bool:
        """Whether `word`, the first word `split(text)` gives, begins where `text` does (words are slices of the
        text unless the pre-tokenizer rewrites characters)."""
        return text.startswith(word)

    def to_json(self) -> dict:
        return {"type": self.type_name}


class ByteLevel(PreTokenizer):
    """GPT-2: optional leading space, split by the GPT-2 regex, then bytes shown as printable characters."""

    type_name = "ByteLevel"

    def __init__(self, add_prefix_space: bool = False, trim_offsets: bool = True, use_regex: bool = True):
        self.add_prefix_space, self.trim_offsets, self.use_regex = add_prefix_space, trim_offsets, use_regex
        self._re = regex.compile(GPT2_FAST)

    def raw_split(self, text: str) -> list[str]:
        """Words before the byte mapping (cache keys for the fast path)."""
        if self.add_prefix_space and text and not text.startswith(" "):
            text = " " + text
        if not self.use_regex:
            return [text] if text else []
        view = onig_view(text)
        if view is text:
            return self._re.findall(text)
        return [text[m.start():m.end()] for m in self._re.finditer(view)]

    def split(self, text: str, first: bool = True) -> list[str]:
        return [byte_level(p) for p in self.raw_split(text)]

    def starts_at_start(self, text: str, word: str) -> bool:
        return True

    def to_json(self) -> dict:
        return {"type": self.type_name, "add_prefix_space": self.add_prefix_space, "trim_offsets": self.trim_offsets,
                "use_regex": self.use_regex}


class Whitespace(PreTokenizer):
    r"""Words `\w+` and runs of other non-space characters `[^\w\s]+`."""

    type_name = "Whitespace"
    _re = regex.compile(r"\w+|[^\w\s]+")

    def split(self, text: str, first: bool = True) -> list[str]:
        view = onig_view(text)
        if view is text:
            return self._re.findall(text)
        return [text[m.start():m.end()] for m in self._re.finditer(view)]


class WhitespaceSplit(PreTokenizer):
    type_name = "WhitespaceSplit"

    def split(self, text: str, first: bool = True) -> list[str]:
        return [w for w in _WHITESPACE_RE.split(text) if w]


def _bert_char(c: str) -> str:
    if is_whitespace(c):
        return " "
    return f" {c} " if is_punctuation(c) else c


class _CharTable(dict):
    """A str.translate table that fills itself, so splitting runs in C."""

    def __missing__(self, cp: int):
        out = self[cp] = _bert_char(chr(cp))
        return out


class BertPreTokenizer(PreTokenizer):
    """Split on whitespace (dropped), then every punctuation character becomes its own word."""

    type_name = "BertPreTokenizer"
    _table = _CharTable()

    def split(self, text: str, first: bool = True) -> list[str]:
        return [w for w in text.translate(self._table).split(" ") if w]


class Metaspace(PreTokenizer):
    """SentencePiece: spaces become `▁` (U+2581), a `▁` is prepended (always / first stretch / never), and
    with split=True every word begins at a `▁`."""

    type_name = "Metaspace"

    def __init__(self, replacement: str = "\u2581", prepend_scheme: str = "always", split: bool = True):
        if prepend_scheme not in ("always", "first", "never"):
            raise TokenizerError(f"Metaspace prepend_scheme must be always, first or never, not {prepend_scheme!r}")
        self.replacement, self.prepend_scheme, self.split_words = replacement, prepend_scheme, split

    def split(self, text: str, first: bool = True) -> list[str]:
        r = self.replacement
        text = text.replace(" ", r)
        if text and (self.prepend_scheme == "always" or (self.prepend_scheme == "first" and first)) \
                and not text.startswith(r):
            text = r + text
        if not self.split_words:
            return [text] if text else []
        out, start = [], 0
        i = text.find(r, 1)
        while i != -1:
            out.append(text[start:i])
            start = i
            i = text.find(r, i + 1)
        if start < len(text):
            out.append(text[start:])
        return [w for w in out if w]

    def starts_at_start(self, text: str, word: str) -> bool:
        return True

    def to_json(self) -> dict:
        return {"type": self.type_name, "replacement": self.replacement, "prepend_scheme": self.prepend_scheme,
                "split": self.split_words}


class Split(PreTokenizer):
    """Split on a literal string or a regex, keeping or merging the matches per `behavior`."""

    type_name = "Split"

    def __init__(self, pattern: dict | str, behavior: str = "Isolated", invert: bool = False):
        if isinstance(pattern, str):
            pattern = {"Regex": pattern}
        if "String" in pattern:
            compiled = regex.compile(regex.escape(pattern["String"]))
        elif "Regex" in pattern:
            try:
                compiled = regex.compile(pattern["Regex"], ONIG_FLAGS)
            except regex.error as exc:
                raise TokenizerError(f"Split pre-tokenizer regex {pattern['Regex']!r} does not compile: {exc}") from exc
        else:
            raise TokenizerError(f"Split pattern must be {{'String': ...}} or {{'Regex': ...}}, not {pattern!r}")
        if behavior not in BEHAVIORS:
            raise TokenizerError(f"unknown split behavior {behavior!r}; use one of {', '.join(BEHAVIORS)}")
        self.pattern, self.behavior, self.invert, self._re = pattern, behavior, invert, compiled
        self._view = regex_view(pattern["Regex"]) if "Regex" in pattern else (lambda text: text)

    def split(self, text: str, first: bool = True) -> list[str]:
        spans = match_spans(self._re, self._view(text), self.invert)  # spans of the view are spans of text
        if self.behavior == "Isolated" and not self.invert:
            return [text[s:e] for s, e, _ in spans if e > s]
        return split_spans(text, spans, self.behavior)

    def to_json(self) -> dict:
        return {"type": self.type_name, "pattern": self.pattern, "behavior": self.behavior, "invert": self.invert}


def char_spans(text: str, is_match) -> list[tuple[int, int, bool]]:
    """Each character that `is_match` accepts as its own span, the runs between them as one span each."""
    spans: list[tuple[int, int, bool]] = []
    for i, c in enumerate(text):
        m = is_match(c)
        if spans and not m and not spans[-1][2]:
            spans[-1] = (spans[-1][0], i + 1, False)
        else:
            spans.append((i, i + 1, m))
    return spans


class Punctuation(PreTokenizer):
    type_name = "Punctuation"

    def __init__(self, behavior: str = "Isolated"):
        self.behavior = behavior

    def split(self, text: str, first: bool = True) -> list[str]:
        return split_spans(text, char_spans(text, is_punctuation), self.behavior)

    def to_json(self) -> dict:
        return {"type": self.type_name, "behavior": self.behavior}


class Digits(PreTokenizer):
    """Numeric characters apart from the rest: each one alone (individual_digits) or runs of them together."""

    type_name = "Digits"

    def __init__(self, individual_digits: bool = False):
        self.individual_digits = individual_digits

    def split(self, text: str, first: bool = True) -> list[str]:
        return split_spans(text, char_spans(text, is_numeric), "Isolated" if self.individual_digits else "Contiguous")

    def to_json(self) -> dict:
        return {"type": self.type_name, "individual_digits": self.individual_digits}


class CharDelimiterSplit(PreTokenizer):
    """Split on one character, which is dropped."""

    type_name = "CharDelimiterSplit"

    def __init__(self, delimiter: str):
        if not isinstance(delimiter, str) or len(delimiter) != 1:
            raise TokenizerError(f"CharDelimiterSplit delimiter must be one character, not {delimiter!r}")
        self.delimiter = delimiter

    def split(self, text: str, first: bool = True) -> list[str]:
        return [w for w in text.split(self.delimiter) if w]

    def to_json(self) -> dict:
        return {"type": self.type_name, "delimiter": self.delimiter}


class FixedLength(PreTokenizer):
    """Pieces of `length` characters (the last one shorter)."""

    type_name = "FixedLength"

    def __init__(self, length: int = 5):
        if not isinstance(length, int) or length < 1:
            raise TokenizerError(f"FixedLength length must be a positive integer, not {length!r}")
        self.length = length

    def split(self, text: str, first: bool = True) -> list[str]:
        return [text[i:i + self.length] for i in range(0, len(text), self.length)]

    def to_json(self) -> dict:
        return {"type": self.type_name, "length": self.length}


class UnicodeScripts(PreTokenizer):
    """A new word wherever the script changes (SentencePiece's split_by_unicode_script, HF's table): characters
    of script "Any" (the space, scripts newer than the table) join either side, Hiragana and Katakana count as
    Han, and, as in HF, text before the first character with a script is dropped."""

    type_name = "UnicodeScripts"

    def split(self, text: str, first: bool = True) -> list[str]:
        cuts, last = [], None
        for i, s in enumerate(map(SCRIPTS.__getitem__, text)):
            if s != "Any":
                if s != last:
                    cuts.append(i)
                last = s
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]


class Sequence(PreTokenizer):
    type_name = "Sequence"

    def __init__(self, pretokenizers: list[PreTokenizer]):
        self.pretokenizers = list(pretokenizers)

    def split(self, text: str, first: bool = True) -> list[str]:
        """Each pre-tokenizer splits every word of the one before; only a first word that still begins at the
        text's start counts as first (HF reads the original offset: Metaspace after WhitespaceSplit does not
        prepend to a text with leading spaces under prepend_scheme "first")."""
        words = [text]
        for p in self.pretokenizers:
            out = []
            for i, piece in enumerate(words):
                parts = p.split(piece, first and i == 0)
                if i == 0:
                    first = first and bool(parts) and p.starts_at_start(piece, parts[0])
                out += parts
            words = out
        return words

    def to_json(self) -> dict:
        return {"type": self.type_name, "pretokenizers": [p.to_json() for p in self.pretokenizers]}


def pre_tokenizer_from_json(d: dict | None) -> PreTokenizer | None:
    if d is None:
        return None
    kind = d.get("type")
    if kind == "ByteLevel":
        return ByteLevel(d.get("add_prefix_space", False), d.get("trim_offsets", True), d.get("use_regex", True))
    if kind in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer"):
        return {"Whitespace": Whitespace, "WhitespaceSplit": WhitespaceSplit, "BertPreTokenizer": BertPreTokenizer}[kind]()
    if kind == "Metaspace":
        scheme = d.get("prepend_scheme")
        if scheme is None:  # files written before prepend_scheme existed
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        return Metaspace(d.get("replacement", "\u2581"), scheme, d.get("split", True))
    if kind == "Split":
        return Split(d["pattern"], d.get("behavior", "Isolated"), d.get("invert", False))
    if kind == "Punctuation":
        return Punctuation(d.get("behavior", "Isolated"))
    if kind == "Digits":
        return Digits(d.get("individual_digits", False))
    if kind == "CharDelimiterSplit":
        return CharDelimiterSplit(d["delimiter"])
    if kind == "FixedLength":
        return FixedLength(d.get("length", 5))
    if kind == "UnicodeScripts":
        return UnicodeScripts()
    if kind == "Sequence":
        return Sequence([pre_tokenizer_from_json(x) for x in d["pretokenizers"]])
    raise TokenizerError(f"unsupported pre_tokenizer type {kind!r} in tokenizer.json; lmkit reads ByteLevel, Whitespace, "
                         "WhitespaceSplit, BertPreTokenizer, Metaspace, Split, Punctuation, Digits, CharDelimiterSplit, "
                         "FixedLength, UnicodeScripts and Sequence")
