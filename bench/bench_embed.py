"""lmkit's word2vec against gensim's Word2Vec: same sentences, same settings, same thread count.

Both sets of vectors are scored by gensim's own evaluators: Spearman rho on WordSim-353 and accuracy on
questions-words.txt (the files shipped in gensim's wheel). Prints words/s and the lmkit / gensim ratios;
both sides' words/s count the same words (in the vocabulary, before subsampling, times the epochs).

    python bench/bench_embed.py [--corpus pydocs] [--epochs 5] [--threads 2] [--seeds 1 2] [--cbow] [--hs]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def scores(words, vectors):
    from gensim.models import KeyedVectors
    from gensim.test.utils import datapath

    kv = KeyedVectors(vectors.shape[1])
    kv.add_vectors(words, vectors)
    rho = kv.evaluate_word_pairs(datapath("wordsim353.tsv"))[1][0]
    analogy = kv.evaluate_word_analogies(datapath("questions-words.txt"))[0]
    return rho, analogy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", nargs="+", default=["pydocs"])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=100)
    ap.add_argument("--min-count", type=int, default=5)
    ap.add_argument("--negative", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--cbow", action="store_true")
    ap.add_argument("--hs", action="store_true")
    args = ap.parse_args()

    from gensim.models import Word2Vec as GensimWord2Vec

    from lmkit.data import load_corpus
    from lmkit.embed import Word2Vec, Word2VecConfig, sentences_of

    sentences = list(sentences_of(load_corpus(args.corpus).texts()))
    n_words = sum(map(len, sentences))
    sg = 0 if args.cbow else 1
    print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}) ({os.cpu_count()} cores visible)")
    print(f"corpus {' '.join(args.corpus)}: {len(sentences)} sentences, {n_words} words; "
          f"{'cbow' if args.cbow else 'skip-gram'}, {'hs + ' if args.hs else ''}negative {args.negative}, "
          f"dim {args.dim}, window 5, sample 1e-3, {args.epochs} epochs, {args.threads} threads")
    rows = {"lmkit": [], "gensim": []}
    for seed in args.seeds:
        cfg = Word2VecConfig(dim=args.dim, negative=args.negative, hs=args.hs, sg=bool(sg), min_count=args.min_count,
                             epochs=args.epochs, seed=seed, threads=args.threads)
        vectors, report = Word2Vec(cfg).train(sentences)
        rows["lmkit"].append((*scores(vectors.words, vectors.vectors), report.words_per_second))
        model = GensimWord2Vec(vector_size=args.dim, window=5, min_count=args.min_count, sample=1e-3, sg=sg,
                               hs=int(args.hs), negative=args.negative, workers=args.threads, seed=seed)
        model.build_vocab(sentences)
        start = time.perf_counter()
        model.train(sentences, total_examples=len(sentences), epochs=args.epochs)
        seconds = time.perf_counter() - start
        # the words lmkit's report counts (in the vocabulary, before subsampling), so that the ratio is of times
        rows["gensim"].append((*scores(model.wv.index_to_key, model.wv.vectors), report.words / seconds))
        for name in rows:
            rho, acc, wps = rows[name][-1]
            print(f"  seed {seed} {name:7s} wordsim353 rho {rho:.3f}  analogy acc {acc:.3f}  words/s {wps:,.0f}")
    print("\n| | WordSim-353 Spearman | analogy accuracy | words/s |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        a = np.array(r)
        sd = a.std(axis=0, ddof=1) if len(a) > 1 else np.zeros(3)
        print(f"| {name} | {a[:, 0].mean():.3f} ± {sd[0]:.3f} | {a[:, 1].mean():.3f} ± {sd[1]:.3f} | {a[:, 2].mean():,.0f} |")
    ratio = np.array(rows["lmkit"]).mean(axis=0) / np.array(rows["gensim"]).mean(axis=0)
    print(f"| lmkit / gensim | {ratio[0]:.2f} | {ratio[1]:.2f} | {ratio[2]:.2f} |")


if __name__ == "__main__":
    main()
