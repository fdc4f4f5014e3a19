"""Decoders: token strings -> text (the `decoder` of tokenizer.json). `decode_chain` maps a token list to
a token list, as in HF, so decoders can be chained; the final text is their concatenation."""
from __future__ import annotations

from lmkit.errors import TokenizerError
from lmkit.tokenizers.chars import CHAR_TO_BYTE
from lmkit.tokenizers.normalizers import replacer


class Decoder:
    type_name = ""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        raise NotImplementedError

    def decode(self, tokens: list[str]) -> str:
        return "".join(self.decode_chain(tokens))

    def to_json(self) -> dict:
        return {"type": self.type_name}


class ByteLevel(Decoder):
    """Inverse of the byte-level map; invalid UTF-8 becomes U+FFFD. A token with a character outside the
    byte alphabet (an added token) contributes its own UTF-8 bytes."""

    type_name = "ByteLevel"

    def __init__(self, add_prefix_space: bool = True, trim_offsets: bool = True, use_regex: bool = True):
        self.add_prefix_space, self.trim_offsets, self.use_regex = add_prefix_space, trim_offsets, use_regex

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = bytearray()
        table = CHAR_TO_BYTE
        for t in tokens:
            try:
                out += bytes([table[c] for c in t])
            except KeyError:
                out += t.encode("utf-8")
        return [out.decode("utf-8", errors="replace")]

    def to_json(self) -> dict:
        return {"type": "ByteLevel", "add_prefix_space": self.add_prefix_space, "trim_offsets": self.trim_offsets,
                "use_regex": self.use_regex}


_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def cleanup(text: str) -> str:
    """Undo the spaces BERT-style splitting puts before punctuation and contractions."""
    for a, b in _CLEANUP:
        text = text.replace(a, b)
    return text


class WordPiece(Decoder):
    """Joins pieces: a `##` piece glues to the previous one, any other piece gets a leading space."""

    type_name = "WordPiece"

    def __init__(self, prefix: str = "##", cleanup: bool = True):
        self.prefix, self.cleanup = prefix, cleanup

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = []
        for i, t in enumerate(tokens):
            if i:
                t = t.replace(self.prefix, "", 1) if t.startswith(self.prefix) else " " + t
            out.append(cleanup(t) if self.cleanup else t)
        return out

    def to_json(self) -> dict:
        return {"type": self.type_name, "prefix": self.prefix, "cleanup": self.cleanup}


class CTC(Decoder):
    """Connectionist temporal classification output (wav2vec2): repeats collapse to one token, the pad (blank)
    token is removed, and with cleanup the word delimiter becomes a space; tokens left empty are dropped."""

    type_name = "CTC"

    def __init__(self, pad_token: str = "<pad>", word_delimiter_token: str = "|", cleanup: bool = True):
        self.pad_token, self.word_delimiter_token, self.cleanup = pad_token, word_delimiter_token, cleanup

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = []
        for i, t in enumerate(tokens):
            if i and t == tokens[i - 1]:
                continue
            t = t.replace(self.pad_token, "")
            if self.cleanup:
                t = cleanup(t).replace(self.word_delimiter_token, " ")
            if t:
                out.append(t)
        return out

    def to_json(self) -> dict:
        return {"type": self.type_name, "pad_token": self.pad_token,
                "word_delimiter_token": self.word_delimiter_token, "cleanup": self.cleanup}


class Metaspace(Decoder):
    """`▁` back to spaces; the `▁` of the first token is dropped unless prepend_scheme is "never"."""

    type_name = "Metaspace"

    def __init__(self, replacement: str = "\u2581", prepend_scheme: str = "always", split: bool = True):
        self.replacement, self.prepend_scheme, self.split = replacement, prepend_scheme, split

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = []
        for i, t in enumerate(tokens):
            if i == 0 and self.prepend_scheme != "never":
                t = t.replace(self.replacement, "")
            out.append(t.replace(self.replacement, " "))
        return out

    def to_json(self) -> dict:
        return {"type": self.type_name, "replacement": self.replacement, "prepend_scheme": self.prepend_scheme,
                "split": self.split}


class BPEDecoder(Decoder):
    """Classic BPE with an end-of-word suffix: the suffix becomes a space (none after the last token)."""

    type_name = "BPEDecoder"

    def __init__(self, suffix: str = "</w>"):
        self.suffix = suffix

    def decode_chain(self, tokens: list[str]) -> list[str]:
        n = len(tokens)
        return [t.replace(self.suffix, "" if i == n - 1 else " ") for i, t in enumerate(tokens)]

    def to_json(self) -> dict:
        return {"type": self.type_name, "suffix": self.suffix}


class Fuse(Decoder):
    """All tokens into one string, nothing between them (character tokenizers)."""

    type_name = "Fuse"

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return ["".join(tokens)]


class Replace(Decoder):
    """Replace every match of a literal string or a regex in every token (Llama's `▁` -> ' ')."""

    type_name = "Replace"

    def __init__(self, pattern: dict, content: str):
        self.pattern, self.content = pattern, content
        self._replace = replacer(pattern, content)

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return [self._replace(t) for t in tokens]

    def to_json(self) -> dict:
        return {"type": self.type_name, "pattern": self.pattern, "content": self.content}


class ByteFallback(Decoder):
    """Runs of `<0xXX>` tokens become the text of those bytes; invalid UTF-8 gives one U+FFFD per byte."""

    type_name = "ByteFallback"

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out, pending = [], bytearray()
        for t in tokens:
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                try:
                    pending.append(int(t[3:5], 16))
                    continue
                except ValueError:
                    pass
            if pending:
                out.extend(_flush(pending))
                pending = bytearray()
            out.append(t)
        if pending:
            out.extend(_flush(pending))
        return out


def _flush(pending: bytearray) -> list[str]:
    try:
        return [pending.decode("utf-8")]
    except UnicodeDecodeError:
        return ["\ufffd"] * len(pending)


class Strip(Decoder):
    """Remove up to `start` leading and `stop` trailing `content` characters from every token."""

    type_name = "Strip"

    def __init__(self, content: str = " ", start: int = 0, stop: int = 0):
        self.content, self.start, self.stop = content, start, stop

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = []
        for t in tokens:
            a, b = 0, len(t)
            while a < min(self.start, len(t)) and t[a] == self.content:
                a += 1
            k = 0
            while k < self.stop and b - 1 >= 0 and t[b - 1] == self.content:
                b -= 1
                k += 1
            out.append(t[a:max(a, b)])
        return out

    def to_json(self) -> dict:
        return {"type": self.type_name, "content": self.content, "start": self.start, "stop": self.stop}


class Sequence(Decoder):
    type_name = "Sequence"

    def __init__(self, decoders: list[Decoder]):
        self.decoders = list(decoders)

    def decode_chain(self, tokens: list[str]) -> list[str]:
        for d in self.decoders:
            tokens = d.decode_chain(tokens)
        return tokens

    def to_json(self) -> dict:
        return {"type": self.type_name, "decoders": [d.to_json() for d in self.decoders]}


def decoder_from_json(d: dict | None) -> Decoder | None:
    if d is None:
        return None
    kind = d.get("type")
    if kind == "ByteLevel":
        return ByteLevel(d.get("add_prefix_space", True), d.get("trim_offsets", True), d.get("use_regex", True))
    if kind == "WordPiece":
        return WordPiece(d.get("prefix", "##"), d.get("cleanup", True))
    if kind == "Metaspace":
        scheme = d.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        return Metaspace(d.get("replacement", "\u2581"), scheme, d.get("split", True))
    if kind == "BPEDecoder":
        return BPEDecoder(d.get("suffix", "</w>"))
    if kind == "Fuse":
        return Fuse()
    if kind == "Replace":
        return Replace(d["pattern"], d["content"])
    if kind == "ByteFallback":
        return ByteFallback()
    if kind == "Strip":
        return Strip(d.get("content", " "), d.get("start", 0), d.get("stop", 0))
    if kind == "CTC":
        return CTC(d.get("pad_token", "<pad>"), d.get("word_delimiter_token", "|"), d.get("cleanup", True))
    if kind == "Sequence":
        return Sequence([decoder_from_json(x) for x in d["decoders"]])
    raise TokenizerError(f"unsupported decoder type {kind!r} in tokenizer.json; lmkit reads ByteLevel, WordPiece, "
                         "Metaspace, BPEDecoder, Fuse, Replace, ByteFallback, Strip, CTC and Sequence")
