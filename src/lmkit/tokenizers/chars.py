"""Character classes shared by normalizers and pre-tokenizers, defined as the Rust `tokenizers` crate does.

Python's `str.isspace` also counts U+001C..U+001F as space; Unicode's White_Space property (what Rust's
`char::is_whitespace` tests) does not, so the set is spelled out here.

HF's tables are of other Unicode versions than Python's `unicodedata` and the `regex` module: `hf_unicode`
lists the code points where they disagree, and the functions here answer as HF does.
"""
from __future__ import annotations

import bisect
import re
import unicodedata

import regex

from lmkit.tokenizers import hf_unicode as _hf


def _chars(ranges) -> frozenset[str]:
    return frozenset(chr(cp) for lo, hi in ranges for cp in range(lo, hi + 1))


def _class(ranges) -> str:
    """A regex character class of the ranges."""
    return "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]"


_BERT_CONTROL_FLIP = _chars(_hf.BERT_CONTROL_FLIP)
_BERT_MN_FLIP = _chars(_hf.BERT_MN_FLIP)
_COMBINING_MARK_FLIP = _chars(_hf.COMBINING_MARK_FLIP)
_NUMERIC_FLIP = _chars(_hf.NUMERIC_FLIP)
_PUNCTUATION_FLIP = _chars(_hf.PUNCTUATION_FLIP)
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _finder(ranges):
    """A fast test for any code point of the ranges in a text: `re` checks a BMP class with a bitmap, while a
    class with astral ranges is checked range by range, so that part runs only on texts with astral chars."""
    bmp = [(lo, min(hi, 0xFFFF)) for lo, hi in ranges if lo <= 0xFFFF]
    astral = [(max(lo, 0x10000), hi) for lo, hi in ranges if hi > 0xFFFF]
    bmp_search = re.compile(_class(bmp)).search if bmp else lambda text: None
    astral_search = re.compile(_class(astral)).search if astral else lambda text: None

    def found(text: str) -> bool:
        return not text.isascii() and (bmp_search(text) is not None or (
            _ASTRAL.search(text) is not None and astral_search(text) is not None))
    return found


def _merge(cps) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for cp in sorted(cps):
        if out and out[-1][1] == cp - 1:
            out[-1][1] = cp
        else:
            out.append([cp, cp])
    return [(lo, hi) for lo, hi in out]


_NORM_UNKNOWN = re.compile(_class(_hf.NORM_UNKNOWN) + "+")
_has_norm_unknown = _finder(_hf.NORM_UNKNOWN)
_REGEX_UNKNOWN = re.compile(_class(_hf.REGEX_UNKNOWN))
_has_regex_unknown = _finder(_hf.REGEX_UNKNOWN)
_has_lower_extra = _finder(_merge(_hf.LOWERCASE))
_LOWER_TABLE = dict(_hf.LOWERCASE)
# unassigned in every Unicode version so far: what Oniguruma makes of the code points in REGEX_UNKNOWN
UNASSIGNED = "\u0378"

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
    """BERT's control class: categories Cc, Cf, Cs, Co except tab, newline and carriage return, in HF's
    (older) category table. Unassigned code points (Cn) are kept."""
    if c in "\t\n\r":
        return False
    cat = unicodedata.category(c)
    return (cat[0] == "C" and cat != "Cn") != (c in _BERT_CONTROL_FLIP)


def is_bert_mark(c: str) -> bool:
    """BertNormalizer's accent test: category Mn in HF's (older) category table."""
    return (unicodedata.category(c) == "Mn") != (c in _BERT_MN_FLIP)


def is_combining_mark(c: str) -> bool:
    """StripAccents' test: categories Mn, Mc, Me in HF's normalization crate (older than Python's tables)."""
    return (unicodedata.category(c)[0] == "M") != (c in _COMBINING_MARK_FLIP)


def is_numeric(c: str) -> bool:
    """Rust's `char::is_numeric`: general categories Nd, Nl and No, in Rust's (newer) tables."""
    return (unicodedata.category(c) in ("Nd", "Nl", "No")) != (c in _NUMERIC_FLIP)


def normalize(form: str, text: str) -> str:
    """unicodedata.normalize as HF's normalization crate does it: code points it does not know stay as they are
    and, being starters that compose with nothing, cut the text into stretches normalized on their own."""
    if text.isascii():
        return text
    if not _has_norm_unknown(text):
        return unicodedata.normalize(form, text)
    out, prev = [], 0
    for m in _NORM_UNKNOWN.finditer(text):
        out += (unicodedata.normalize(form, text[prev:m.start()]), m.group())
        prev = m.end()
    out.append(unicodedata.normalize(form, text[prev:]))
    return "".join(out)


def lower_extra(text: str) -> str:
    """Lowercase the characters Rust's `char::to_lowercase` knows and Python's `str.lower` does not."""
    return text.translate(_LOWER_TABLE) if _has_lower_extra(text) else text


def onig_view(text: str) -> str:
    """`text` with the code points Oniguruma (HF's regex engine) leaves unassigned but the `regex` module
    classifies replaced by an unassigned one, one for one: match on this, slice the original."""
    if not _has_regex_unknown(text):
        return text
    return _REGEX_UNKNOWN.sub(UNASSIGNED, text)


def grapheme_pattern(unknown=()) -> str:
    """UAX #29's extended grapheme cluster as a regex (its Table 1c form, with GB9c's Indic conjuncts) on the
    `regex` module's properties, minus the `unknown` code points, which count as unassigned (GCB Other). The
    `regex` module's own \\X is not used: it joins a virama to a following consonant without the consonant GB9c
    needs before it."""
    unknown = f"--{_class(unknown)}" if unknown else ""

    def cls(*props: str) -> str:
        body = "".join(rf"\p{{{p}}}" for p in props)
        return f"[[{body}]{unknown}]"

    control = cls("GCB=Control", "GCB=CR", "GCB=LF")
    L, V, T, LV, LVT = (cls(f"GCB={k}") for k in ("L", "V", "T", "LV", "LVT"))
    ri, pict, extend, zwj = cls("GCB=RI"), cls("ExtPict"), cls("GCB=Extend"), cls("GCB=ZWJ")
    consonant, linker, joiner = cls("InCB=Consonant"), cls("InCB=Linker"), cls("InCB=Extend", "InCB=Linker")
    core = "|".join((f"{L}*(?:{V}+|{LV}{V}*|{LVT}){T}*|{L}+|{T}+", f"{ri}{ri}", f"{pict}(?:{extend}*{zwj}{pict})*",
                     f"{consonant}(?:{joiner}*{linker}{joiner}*{consonant})+", f"(?!{control})."))
    post = cls("GCB=Extend", "GCB=ZWJ", "GCB=SpacingMark")
    # most characters have no part in any rule: tried first, alone when no mark follows, so the common case skips the rules
    special = "".join(rf"\p{{{p}}}" for p in (
        "GCB=Control", "GCB=CR", "GCB=LF", "GCB=L", "GCB=V", "GCB=T", "GCB=LV", "GCB=LVT", "GCB=RI", "ExtPict",
        "InCB=Consonant", "GCB=Prepend", "GCB=Extend", "GCB=ZWJ", "GCB=SpacingMark"))
    return f"(?V1s)[^{special}](?!{post})|\\r\\n|{control}|{cls('GCB=Prepend')}*(?:{core}){post}*"


# HF's grapheme clusters (the Precompiled normalizer walks the text by them)
GRAPHEME = regex.compile(grapheme_pattern(_hf.GRAPHEME_UNKNOWN))


# the scripts of HF's UnicodeScripts table (SentencePiece's, of Unicode 9); a character of a later script, or of
# none, is "Any" there, as the space is
HF_SCRIPTS = tuple("""
    Adlam Ahom AnatolianHieroglyphs Arabic Armenian Avestan Balinese Bamum BassaVah Batak Bengali Bhaiksuki Bopomofo
    Brahmi Braille Buginese Buhid CanadianAboriginal Carian CaucasianAlbanian Chakma Cham Cherokee Common Coptic
    Cuneiform Cypriot Cyrillic Deseret Devanagari Duployan EgyptianHieroglyphs Elbasan Ethiopic Georgian Glagolitic
    Gothic Grantha Greek Gujarati Gurmukhi Han Hangul Hanunoo Hatran Hebrew Hiragana ImperialAramaic Inherited
    InscriptionalPahlavi InscriptionalParthian Javanese Kaithi Kannada Katakana KayahLi Kharoshthi Khmer Khojki
    Khudawadi Lao Latin Lepcha Limbu LinearA LinearB Lisu Lycian Lydian Mahajani Malayalam Mandaic Manichaean Marchen
    MeeteiMayek MendeKikakui MeroiticCursive MeroiticHieroglyphs Miao Modi Mongolian Mro Multani Myanmar Nabataean
    NewTaiLue Newa Nko Ogham OlChiki OldHungarian OldItalic OldNorthArabian OldPermic OldPersian OldSouthArabian
    OldTurkic Oriya Osage Osmanya PahawhHmong Palmyrene PauCinHau PhagsPa Phoenician PsalterPahlavi Rejang Runic
    Samaritan Saurashtra Sharada Shavian Siddham SignWriting Sinhala SoraSompeng Sundanese SylotiNagri Syriac Tagalog
    Tagbanwa TaiLe TaiTham TaiViet Takri Tamil Tangut Telugu Thaana Thai Tibetan Tifinagh Tirhuta Ugaritic Vai
    WarangCiti Yi""".split())
_SCRIPT = regex.compile("|".join(rf"(\p{{Script={name}}})" for name in HF_SCRIPTS))


def regex_script(c: str) -> str:
    """The script UnicodeScripts gives `c` from the `regex` module's Script property: Hiragana, Katakana and
    U+30FC count as Han, the space and characters of scripts HF's table lacks as "Any"."""
    if c == "\u30fc":
        return "Han"
    m = _SCRIPT.match(c) if c != " " else None
    if m is None:
        return "Any"
    name = HF_SCRIPTS[m.lastindex - 1]
    return "Han" if name in ("Hiragana", "Katakana") else name


class _Scripts(dict):
    """char -> HF's script: `regex_script` corrected by hf_unicode.SCRIPT_FLIP (HF's older table), cached."""

    def __init__(self):
        super().__init__()
        self.starts = [lo for lo, _, _ in _hf.SCRIPT_FLIP]

    def __missing__(self, c: str) -> str:
        cp = ord(c)
        k = bisect.bisect_right(self.starts, cp) - 1
        out = _hf.SCRIPT_FLIP[k][2] if k >= 0 and cp <= _hf.SCRIPT_FLIP[k][1] else regex_script(c)
        if len(self) < 1 << 16:
            self[c] = out
        return out


SCRIPTS = _Scripts()


def has_regex_unknown(pattern: str) -> bool:
    return _has_regex_unknown(pattern)


def is_punctuation(c: str) -> bool:
    """BERT's punctuation: ASCII punctuation (which includes symbols like `$` and `+`) or Unicode category P*, in
    HF's (older) category table."""
    return (c in _ASCII_PUNCT or unicodedata.category(c)[0] == "P") != (c in _PUNCTUATION_FLIP)


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
