"""Language identification (`lmkit data clean --languages`) measured on a multilingual sample built offline.

The sample comes from what is installed, nothing downloaded:
- English: 300 documents of the built-in `pydocs` corpus (Python's documentation), and 100 of `pycode` (source
  code, English identifiers and comments: the filter should keep it);
- Russian: paragraphs of the opening of Crime and Punishment that the gensim wheel ships for its tests;
- Bulgarian: paragraphs of the Bulgarian Wikipedia extract the gensim wheel ships;
- German, French, Spanish, Italian, Portuguese, Dutch, Polish, Swedish, Turkish, Chinese, Japanese: documents of 25
  CLDR display names (countries, languages, currencies) of that locale, from the babel wheel. These are names, not
  running text: identification on them is harder than on prose, so their row is a lower bound.

Prints the per-language accuracy and the precision and recall of `--languages en`.   python bench/bench_language_id.py
"""
from __future__ import annotations

import bz2
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

from lmkit.data import load_corpus  # noqa: E402
from lmkit.data.language import detect_language  # noqa: E402

CLDR = ("de", "fr", "es", "it", "pt", "nl", "pl", "sv", "tr", "zh", "ja")


def gensim_paragraphs(name: str, limit: int, min_chars: int = 200) -> list[str]:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / name
    text = bz2.open(path, "rt", encoding="utf-16").read() if name.endswith(".bz2") else path.read_text("utf-8")
    text = re.sub(r"<[^>]+>|\{\{[^}]*\}\}|\[\[(?:[^|\]]*\|)?([^\]]*)\]\]|'''?|&\w+;", r"\1", text)
    paras, current = [], ""
    for line in text.splitlines():  # lines joined until a paragraph of min_chars
        current = f"{current} {line.strip()}".strip()
        if len(current) >= min_chars:
            paras.append(current)
            current = ""
    return paras[:limit]


def cldr_documents(locale: str, count: int, words: int = 25) -> list[str]:
    from babel import Locale

    loc = Locale.parse(locale)
    names = sorted({*loc.territories.values(), *loc.languages.values(), *loc.currencies.values()})
    rng = random.Random(locale)
    return [", ".join(rng.sample(names, words)) + "." for _ in range(count)]


def main() -> None:
    sample: dict[str, list[str]] = {"en": [d.text for d in load_corpus("pydocs").documents[:300]],
                                    "en (code)": [d.text for d in load_corpus("pycode").documents[:100]],
                                    "ru": gensim_paragraphs("crime-and-punishment.txt", 60),
                                    "bg": gensim_paragraphs("bgwiki-latest-pages-articles-shortened.xml.bz2", 60)}
    for locale in CLDR:
        sample[f"{locale} (CLDR names)"] = cldr_documents(locale, 40)
    t = time.perf_counter()
    found = {name: [detect_language(text) for text in texts] for name, texts in sample.items()}
    seconds = time.perf_counter() - t
    print(machine.describe(["fp32"]))
    print(f"{sum(map(len, sample.values()))} documents identified in {seconds:.1f} s\n")
    print("| sample | documents | identified as its language | most common other answer |\n|---|---|---|---|")
    for name, answers in found.items():
        code = name.split()[0]
        right = sum(a == code for a in answers)
        others = [a for a in answers if a != code]
        common = max(set(others), key=others.count) if others else ""
        print(f"| {name} | {len(answers)} | {right / len(answers):.1%} | {common} |")
    kept = {name: sum(a == "en" for a in answers) for name, answers in found.items()}
    english = [n for n in found if n.startswith("en")]
    tp = sum(kept[n] for n in english)
    fp = sum(v for n, v in kept.items() if n not in english)
    positives = sum(len(found[n]) for n in english)
    print(f"\n`--languages en`: precision {tp / max(tp + fp, 1):.3f}, recall {tp / positives:.3f} "
          f"({tp} of {positives} English documents kept, {fp} others kept)")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
