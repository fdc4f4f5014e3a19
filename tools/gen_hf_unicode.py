"""Write src/lmkit/tokenizers/hf_unicode.py: where Hugging Face `tokenizers`' character tables disagree with
Python's `unicodedata` and with the `regex` module.

Run it with the `tokenizers` wheel whose behaviour lmkit follows, on the Python whose `unicodedata` lmkit uses
(`sentencepiece` builds the charsmap that shows HF's grapheme clusters):

    python tools/gen_hf_unicode.py            # rewrites the module
    python tools/gen_hf_unicode.py --check    # exits 1 when the module is stale

Every table is found by probing `tokenizers` with each code point (0..0x10FFFF minus surrogates), alone or in
a small context that makes the property visible, and keeping those where HF's answer differs from the one
lmkit would get from Python / `regex` alone. Nothing here is imported at run time.
"""
from __future__ import annotations

import argparse
import textwrap
import sys
import unicodedata
from pathlib import Path

import regex
import tokenizers
from tokenizers import normalizers as N
from tokenizers import pre_tokenizers as P

OUT = Path(__file__).resolve().parents[1] / "src" / "lmkit" / "tokenizers" / "hf_unicode.py"
CPS = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


def pack(items: list[str]) -> list[str]:
    """Source lines of at most 116 characters holding the items, indented by 4."""
    out, row = [], "   "
    for it in items:
        if len(row) + len(it) + 1 > 116:
            out.append(row)
            row = "   "
        row += " " + it
    return out + [row] if row.strip() else out


def ranges(cps) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for cp in sorted(set(cps)):
        if out and out[-1][1] == cp - 1:
            out[-1][1] = cp
        else:
            out.append([cp, cp])
    return [(a, b) for a, b in out]


def norm_unknown() -> list[int]:
    """Code points the normalization crate does not know but Python does: their decomposition, combining class
    or composition differs. HF treats them as starters with no decomposition that compose with nothing."""
    hf = {f: getattr(N, f)() for f in ("NFC", "NFD", "NFKD")}
    out = set()
    for cp in CPS:
        c = chr(cp)
        # decomposition (canonical, compatibility)
        if any(hf[f].normalize_str(c) != unicodedata.normalize(f, c) for f in ("NFD", "NFKD")):
            out.add(cp)
        # canonical combining class: reordering around U+0334 (ccc 1) and U+0301 (ccc 230)
        for s in ("a" + c + "\u0334", "a\u0301" + c, "a\u0334" + c):
            if hf["NFD"].normalize_str(s) != unicodedata.normalize("NFD", s):
                out.add(cp)
                break
        # composition: a primary composite HF does not rebuild from its decomposition
        d = unicodedata.normalize("NFD", c)
        if d != c and hf["NFC"].normalize_str(d) != unicodedata.normalize("NFC", d):
            out.update(map(ord, d))
    return sorted(out)


def grapheme_unknown() -> list[int]:
    """Code points HF's grapheme segmentation (seen through the Precompiled normalizer) treats as unassigned where
    lmkit's UAX #29 pattern on the `regex` module's properties does not. Probe: a charsmap mapping every character
    to "x" ("x" to "y"), so a cluster of under 6 bytes comes out as one character and a longer one as one per
    character."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    sys.path.insert(0, str(OUT.parents[2]))
    from lmkit.tokenizers.chars import grapheme_pattern

    sentencepiece.set_min_log_level(3)
    rules = [(chr(cp), "y" if cp == ord("x") else "x") for cp in CPS if cp]
    spec = sentencepiece_model_pb2.NormalizerSpec()
    spec.ParseFromString(sentencepiece.SentencePieceNormalizer(
        norm_map=rules, add_dummy_prefix=False, escape_whitespaces=False,
        remove_extra_whitespaces=False).serialized_normalizer_spec())
    hf = N.Precompiled(spec.precompiled_charsmap)
    # joins the previous character, starts a cluster with the next (Prepend), breaks before marks (Control),
    # is an Indic_Conjunct_Break Linker, Consonant, Extend (rule GB9c)
    contexts = ("a{}", "\u0300{}", "{}a", "{}\u0300\u0300", "\u0915{}\u0915\u0300", "\u0915\u094d{}\u0300",
                "\u0915\u094d{}\u0915\u0300")

    def ours(cluster, c: str) -> list[str]:
        return ["".join(("y" if g[0] == "x" else "x") if len(g.encode()) < 6 else "".join(
            "y" if ch == "x" else "x" for ch in g) for g in cluster.findall(ctx.format(c))) for ctx in contexts]

    base = regex.compile(grapheme_pattern())
    out = []
    for cp in CPS[1:]:
        got = [hf.normalize_str(ctx.format(chr(cp))) for ctx in contexts]
        if got != ours(base, chr(cp)):
            if got != ours(regex.compile(grapheme_pattern([(cp, cp)])), chr(cp)):
                raise SystemExit(f"U+{cp:04X}: HF's grapheme clusters {got} are neither lmkit's nor an unassigned "
                                 "code point's; extend lmkit.tokenizers.chars.grapheme_pattern")
            out.append(cp)
    return out


def script_flip() -> dict[int, str]:
    """HF's UnicodeScripts script of every code point where lmkit's `regex_script` (the `regex` module's Script
    property on HF's script list) gives another. Probe: two characters stay one piece when their scripts are equal
    or one is "Any"; a character is "Any" when it joins both a Latin and a Common neighbour."""
    sys.path.insert(0, str(OUT.parents[2]))
    from lmkit.tokenizers.chars import regex_script

    pre = P.UnicodeScripts()

    def one(text: str) -> bool:
        return len(pre.pre_tokenize_str(text)) == 1

    reps = {}
    for cp in CPS:
        reps.setdefault(regex_script(chr(cp)), chr(cp))
    out = {}
    for cp in CPS:
        c = chr(cp)
        ours, any_ = regex_script(c), one("a" + c + "a") and one("1" + c + "1")
        if (ours == "Any") == any_ and (any_ or one(reps[ours] + c)):
            continue
        theirs = "Any" if any_ else next((name for name, r in reps.items() if name != "Any" and one(r + c)), None)
        if theirs is None:
            raise SystemExit(f"U+{cp:04X}: HF's UnicodeScripts puts it in no script lmkit knows")
        out[cp] = theirs
    return out


def flips(hf_pred, py_pred) -> list[int]:
    return [cp for cp in CPS if hf_pred(chr(cp)) != py_pred(chr(cp))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    strip = N.StripAccents()
    combining = flips(lambda c: strip.normalize_str(c) == "", lambda c: unicodedata.category(c)[0] == "M")

    clean = N.BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=False)
    control = flips(lambda c: c not in "\x00\ufffd" and clean.normalize_str(c) == "",
                    lambda c: c not in "\t\n\r\x00\ufffd" and unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs"))

    nfd = N.NFD()
    mn = N.BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True, lowercase=False)
    # only characters NFD keeps matter: the Mn test runs on NFD's output
    bert_mn = [cp for cp in CPS if nfd.normalize_str(chr(cp)) == chr(cp)
               and (mn.normalize_str(chr(cp)) == "") != (unicodedata.category(chr(cp)) == "Mn")]

    punct = P.Punctuation()
    ascii_punct = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    punctuation = flips(lambda c: len(punct.pre_tokenize_str("a" + c + "a")) == 3,
                        lambda c: c in ascii_punct or unicodedata.category(c)[0] == "P")

    digits = P.Digits(individual_digits=True)
    numeric = flips(lambda c: len(digits.pre_tokenize_str("a" + c + "a")) == 3,
                    lambda c: unicodedata.category(c) in ("Nd", "Nl", "No"))

    lower = N.Lowercase()
    lowercase = {cp: lower.normalize_str(chr(cp)) for cp in CPS
                 if lower.normalize_str(chr(cp)) != chr(cp).replace("\u03a3", "\u03c3").lower()}

    # Oniguruma (HF's regex engine) against the `regex` module, on \w (Whitespace), \p{L} and \p{N} (ByteLevel)
    ws, bl = P.Whitespace(), P.ByteLevel(add_prefix_space=False, use_regex=True)
    word, letter, number = regex.compile(r"\w"), regex.compile(r"\p{L}"), regex.compile(r"\p{N}")
    onig = set(flips(lambda c: len(ws.pre_tokenize_str("a" + c + "a")) == 1, lambda c: bool(word.match(c))))
    onig |= set(flips(lambda c: len(bl.pre_tokenize_str("a" + c + "a")) == 1, lambda c: bool(letter.match(c))))
    onig |= set(flips(lambda c: len(bl.pre_tokenize_str("1" + c + "1")) == 1, lambda c: bool(number.match(c))))

    scripts = script_flip()
    tables = {
        "NORM_UNKNOWN": (norm_unknown(), "code points the normalization crate does not know (their decomposition, "
                         "combining class or composition differs from Python's): starters that decompose and "
                         "compose with nothing"),
        "COMBINING_MARK_FLIP": (combining, "StripAccents' combining marks (categories Mn, Mc, Me) that differ from "
                                "Python's categories"),
        "BERT_CONTROL_FLIP": (control, "BertNormalizer clean_text's control characters (Cc, Cf, Co, Cs) that differ "
                              "from Python's categories"),
        "BERT_MN_FLIP": (bert_mn, "BertNormalizer strip_accents' nonspacing marks (Mn) that differ from Python's "
                         "categories (only characters NFD keeps)"),
        "PUNCTUATION_FLIP": (punctuation, "Punctuation's and BertPreTokenizer's punctuation (ASCII punctuation or "
                             "categories P*) that differs from Python's categories"),
        "NUMERIC_FLIP": (numeric, "Digits' numeric characters (Rust's char::is_numeric: Nd, Nl, No) that differ "
                         "from Python's categories"),
        "REGEX_UNKNOWN": (sorted(onig), "code points the `regex` module gives a word/letter/number class but "
                          "Oniguruma, HF's regex engine, leaves unassigned"),
        "GRAPHEME_UNKNOWN": (grapheme_unknown(), "code points HF's grapheme segmentation (Precompiled) leaves "
                             "unassigned but the `regex` module's grapheme properties do not"),
    }
    lines = [
        'r"""Where Hugging Face `tokenizers`\' character tables disagree with Python\'s `unicodedata` and the `regex`',
        "module. GENERATED by tools/gen_hf_unicode.py; do not edit.",
        "",
        f"Derived from tokenizers {tokenizers.__version__} on Python {sys.version.split()[0]} (unicodedata "
        f"{unicodedata.unidata_version}) and regex {regex.__version__}.",
        *textwrap.wrap(
            "HF's Rust crates carry Unicode tables of different ages: its normalization crate (NFC/NFD/NFKC/NFKD and "
            "StripAccents' combining marks) and its category tables (BertNormalizer's control and Mn tests, "
            "Punctuation) predate Unicode 14, Rust's own char methods (Lowercase, Digits) are newer, and its regex "
            "engines' classes (\\w, \\p{L}, \\p{N}) and its grapheme segmentation are older than the `regex` "
            "module's. The generator probes `tokenizers` with every code point (0..0x10FFFF minus surrogates), alone "
            "or in a context that shows the property (a base letter before a mark, a reordering neighbour of a known "
            "combining class, letters around a regex class), and keeps the code points where HF's answer differs "
            "from Python's / `regex`'s. *_FLIP tables: the property is the opposite of Python's; *_UNKNOWN tables: "
            "HF treats the code point as unassigned. Ranges are inclusive (start, end) pairs.", 112),
        '"""',
        "",
        f'UNIDATA_VERSION = "{unicodedata.unidata_version}"',
        "",
    ]
    for name, (cps, doc) in tables.items():
        lines += textwrap.wrap(doc, 116, initial_indent="# ", subsequent_indent="# ")
        rs = ranges(cps)
        lines.append(f"{name} = (")
        lines += pack([f"(0x{a:04X}, 0x{b:04X})," for a, b in rs])
        lines.append(")")
        lines.append("")
    lines.append("# UnicodeScripts: HF's script (its table is of Unicode 9) where it differs from the `regex` module's "
                 "Script on")
    lines.append("# HF's script list (lmkit.tokenizers.chars.regex_script); (start, end, script)")
    lines.append("SCRIPT_FLIP = (")
    runs: list[list] = []
    for cp, name in sorted(scripts.items()):
        if runs and runs[-1][1] == cp - 1 and runs[-1][2] == name:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp, name])
    lines += pack([f"(0x{a:04X}, 0x{b:04X}, {name!r})," for a, b, name in runs])
    lines.append(")")
    lines.append("")
    lines.append("# Rust's char::to_lowercase where Python's str.lower (Unicode " + unicodedata.unidata_version
                 + ") leaves the character alone")
    lines.append("LOWERCASE = {")
    items = [f"0x{cp:04X}: {ascii(s)}," for cp, s in sorted(lowercase.items())]
    lines += textwrap.wrap(" ".join(items), 116, initial_indent="    ", subsequent_indent="    ")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if args.check:
        return 0 if OUT.read_text() == text else 1
    OUT.write_text(text)
    for name, (cps, _) in tables.items():
        print(name, len(cps), "code points,", len(ranges(cps)), "ranges")
    print("SCRIPT_FLIP", len(scripts), "code points")
    print("LOWERCASE", len(lowercase))
    return 0


if __name__ == "__main__":
    sys.exit(main())
