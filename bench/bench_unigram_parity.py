"""How close lmkit's Unigram trainer comes to Hugging Face `tokenizers`' UnigramTrainer, corpus by corpus.

    python bench/bench_unigram_parity.py [--sizes 300 1000 4000 8192] [--corpora pydocs pydocs-200k unicode]
                                         [--hf-threads 1]

Both libraries train on the same texts with the same pipeline (NFKC, Metaspace "always") and settings
(special tokens <pad> </s> <unk>, unk <unk>, every other setting at `tokenizers`' default). For each corpus
and vocabulary size it prints a markdown row: the share of `tokenizers`' pieces that lmkit also learned,
the mean |score difference| over the shared non-special pieces, the largest one, and both training times.
A size below the corpus's alphabet is refused by both libraries and shows as such.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import machine  # bench/machine.py (the script's folder is on sys.path)


def pydocs(limit_chars: int | None = None) -> list[str]:
    from lmkit.data.builtin import builtin_corpus

    texts, n = [], 0
    for d in builtin_corpus("pydocs").documents:
        if limit_chars is not None and n >= limit_chars:
            break
        t = d.text if limit_chars is None else d.text[:limit_chars - n]
        texts.append(t)
        n += len(t)
    return texts


def unicode_text(n_words: int = 60_000, seed: int = 0) -> list[str]:
    """Sentences over a Zipf-distributed lexicon whose words mix Latin with diacritics, Greek, Cyrillic,
    Arabic, Devanagari, CJK, Hangul and emoji (some combining marks that NFKC composes)."""
    rng = random.Random(seed)
    scripts = ["abcdefghijklmnopqrstuvwxyzéèêüöäßçñ", "αβγδεζηθικλμνξοπρστυφχψω", "абвгдежзийклмнопрстуфхцчшщыэюя",
               "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "कखगघचछजझटठडढणतथदधनपफबभमयरलवशसह", "的一是不了人我在有他这中大来上国个到说们为子",
               "가나다라마바사아자차카타파하", "😀😂🤖🎉👍🌍", "0123456789"]
    lexicon = []
    for _ in range(4000):
        s = rng.choice(scripts)
        w = "".join(rng.choice(s) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.05:
            w += "\u0301"  # a combining acute accent: NFKC composes it where a precomposed form exists
        lexicon.append(w)
    weights = [1 / (r + 1) for r in range(len(lexicon))]
    words = rng.choices(lexicon, weights, k=n_words)
    return [" ".join(words[i:i + 12]) + rng.choice([".", "!", "?", "。"]) for i in range(0, n_words, 12)]


CORPORA = {"pydocs": lambda: pydocs(), "pydocs-200k": lambda: pydocs(200_000), "unicode": unicode_text}
SPECIALS = ["<pad>", "</s>", "<unk>"]


def hf_train(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return dict(map(tuple, json.loads(tok.to_str())["model"]["vocab"]))


def lmkit_train(texts: list[str], vocab_size: int):
    from lmkit.tokenizers import train_tokenizer

    return dict(train_tokenizer(texts, "unigram", vocab_size, special_tokens=SPECIALS).model.pieces)


def compare(ours: dict, hf: dict) -> tuple[float, float, float]:
    shared = [p for p in hf if p in ours]
    diffs = [abs(ours[p] - hf[p]) for p in shared if p not in SPECIALS]
    return len(shared) / len(hf), sum(diffs) / max(1, len(diffs)), max(diffs, default=0.0)


def timed(fn):
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a refused size is a result here
        out = e
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    ap.add_argument("--sizes", nargs="+", type=int, default=[300, 1000, 4000, 8192])
    ap.add_argument("--hf-threads", type=int, default=None, help="RAYON_NUM_THREADS for tokenizers")
    ap.add_argument("--dump", default=None, help="folder to write both vocabularies to (json)")
    args = ap.parse_args(argv)
    if args.hf_threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.hf_threads)  # read when tokenizers first starts its pool
    import tokenizers

    print(f"tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"tokenizers threads: {os.environ.get('RAYON_NUM_THREADS', 'default')}\n")
    print(machine.describe([]))
    print("| corpus | vocab | shared pieces | mean abs score diff | max abs score diff | lmkit s | tokenizers s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.corpora:
        texts = CORPORA[name]()
        for size in args.sizes:
            hf, t_hf = timed(lambda: hf_train(texts, size))
            ours, t_ours = timed(lambda: lmkit_train(texts, size))
            if isinstance(hf, Exception) or isinstance(ours, Exception):
                said = ", ".join(f"{who} {type(r).__name__ if isinstance(r, Exception) else 'trained'}"
                                 for who, r in (("tokenizers", hf), ("lmkit", ours)))
                print(f"| {name} | {size} | refused ({said}) | | | {t_ours:.2f} | {t_hf:.2f} |")
                continue
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for who, v in (("hf", hf), ("lmkit", ours)):
                    with open(os.path.join(args.dump, f"{name}-{size}-{who}.json"), "w", encoding="utf-8") as f:
                        json.dump(v, f, ensure_ascii=False)
            frac, mean, worst = compare(ours, hf)
            print(f"| {name} | {size} | {frac:.4f} ({len(hf)} in tokenizers, {len(ours)} in lmkit) | {mean:.2e} | "
                  f"{worst:.2e} | {t_ours:.2f} | {t_hf:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
