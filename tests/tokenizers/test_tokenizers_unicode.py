"""Every code point (0..0x10FFFF minus surrogates) through each normalizer and pre-tokenizer, side by side with
Hugging Face `tokenizers`, alone and in contexts that expose Unicode-version differences: a base letter before
combining marks, reordering neighbours, letters and digits around regex classes. HF's character tables are of
other Unicode versions than Python's; lmkit.tokenizers.hf_unicode records where (tools/gen_hf_unicode.py)."""
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex  # noqa: E402
from tokenizers import normalizers as N  # noqa: E402
from tokenizers import pre_tokenizers as P  # noqa: E402

from lmkit.tokenizers.normalizers import normalizer_from_json  # noqa: E402
from lmkit.tokenizers.pre_tokenizers import GPT4_PATTERN, pre_tokenizer_from_json  # noqa: E402

CPS = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
CHUNK = 1 << 14


def state(component) -> dict:
    return json.loads(component.__getstate__())


def sweep(ours, theirs, prefix: str, suffix: str) -> list[str]:
    """Code points whose unit prefix+c+suffix comes out differently, checked a chunk of units at a time."""
    bad = []
    for i in range(0, len(CPS), CHUNK):
        chunk = CPS[i:i + CHUNK]
        if ours("".join(prefix + chr(cp) + suffix for cp in chunk)) == theirs(
                "".join(prefix + chr(cp) + suffix for cp in chunk)):
            continue
        for cp in chunk:
            unit = prefix + chr(cp) + suffix
            if ours(unit) != theirs(unit):
                bad.append(f"U+{cp:04X}: {ours(unit)!r} != {theirs(unit)!r}")
                if len(bad) >= 10:
                    return bad
    return bad


NORMALIZERS = [
    (N.NFC(), ["", "a\u0301", "\u1100"], ["", "\u0334\u0301", "\u1161\u0345"]),
    (N.NFD(), ["", "a\u0334"], ["", "\u0316\u0301"]),
    (N.NFKC(), ["", "a\u0301"], ["", "\u0334\u0301"]),
    (N.NFKD(), ["", "e\u0308"], ["", "\u0323x"]),
    (N.Lowercase(), ["", "A"], ["", "\u03a3"]),
    (N.StripAccents(), ["a"], ["a"]),
    (N.Sequence([N.NFD(), N.StripAccents()]), ["", "\u00e9"], ["", "\u0301"]),
    (N.BertNormalizer(), ["", "\u00c9"], ["", "\u0301"]),
    (N.BertNormalizer(lowercase=False), [""], [""]),
    (N.BertNormalizer(strip_accents=True, lowercase=False), ["a"], ["\u0334"]),
    (N.BertNormalizer(clean_text=False, handle_chinese_chars=False), ["A"], ["\u03a3"]),
    (N.Replace(Regex(r"\p{L}+|\d"), "-"), ["a"], ["b"]),
]


@pytest.mark.parametrize("hf,prefixes,suffixes", NORMALIZERS, ids=[json.dumps(state(h))[:70] for h, _, _ in NORMALIZERS])
def test_normalizer_on_every_code_point(hf, prefixes, suffixes):
    ours = normalizer_from_json(state(hf))
    for prefix, suffix in zip(prefixes, suffixes):
        assert sweep(ours.normalize, hf.normalize_str, prefix, suffix) == [], (prefix, suffix)


PRE_TOKENIZERS = [
    (P.Punctuation(), ["a"], ["a"]),
    (P.BertPreTokenizer(), ["a"], ["a"]),
    (P.Whitespace(), ["a", "! "], ["a", "!"]),
    (P.WhitespaceSplit(), ["a"], ["a"]),
    (P.Digits(), ["a"], ["1"]),
    (P.Digits(individual_digits=True), ["1 "], ["a"]),
    (P.ByteLevel(add_prefix_space=False), ["a", "1"], ["a", "!"]),
    (P.Metaspace(), ["a "], [" "]),
    (P.Split(Regex(GPT4_PATTERN), "isolated"), ["!"], [" a"]),
]


@pytest.mark.parametrize("hf,prefixes,suffixes", PRE_TOKENIZERS, ids=[json.dumps(state(h))[:70] for h, _, _ in PRE_TOKENIZERS])
def test_pre_tokenizer_on_every_code_point(hf, prefixes, suffixes):
    ours = pre_tokenizer_from_json(state(hf))
    theirs = lambda s: [w for w, _ in hf.pre_tokenize_str(s)]  # noqa: E731
    for prefix, suffix in zip(prefixes, suffixes):
        assert sweep(ours.split, theirs, prefix, suffix) == [], (prefix, suffix)


def test_generated_tables_are_current():
    """The tables match what the generator derives from the installed `tokenizers` (slow: run on demand)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if not os.environ.get("LMKIT_CHECK_UNICODE_TABLES"):
        pytest.skip("set LMKIT_CHECK_UNICODE_TABLES=1 to rerun tools/gen_hf_unicode.py --check (about 30 s)")
    tool = Path(__file__).resolve().parents[2] / "tools" / "gen_hf_unicode.py"
    assert subprocess.run([sys.executable, str(tool), "--check"]).returncode == 0
