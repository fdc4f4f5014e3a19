"""`lmkit embed`: word vectors. `train` runs word2vec (skip-gram or CBOW, negative sampling and/or
hierarchical softmax) on a corpus; `similar` prints a word's nearest neighbours or an analogy's answers.

train writes DIR/vectors.safetensors, DIR/vocab.json (words most frequent first, their counts) and
DIR/vectors.txt in the word2vec text format (gensim's KeyedVectors.load_word2vec_format reads it).
"""
from __future__ import annotations

import argparse

from lmkit.cli.helptext import add_command, hidden_alias
from lmkit.data import load_corpus
from lmkit.data.corpus import refuse_output_folder
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = add_command(subparsers, "embed", help="train word vectors (word2vec) and query them", description=__doc__,
                    example_lines=("lmkit embed train --out vectors/", "lmkit embed similar --vectors vectors/ list"))
    sub = p.add_subparsers(dest="embed_command", metavar="ACTION")
    t = add_command(sub, "train", help="train word2vec vectors on a corpus",
                    description="Train word2vec vectors (skip-gram or CBOW, negative sampling and/or hierarchical "
                                "softmax) on a corpus, as the original C tool and gensim do.", example_lines=(
                        "lmkit embed train --out vectors/                       # skip-gram on pydocs",
                        "lmkit embed train --corpus notes/ --out vectors/ --cbow --dim 200 --epochs 10"))
    t.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl; default: pydocs")
    t.add_argument("--out", required=True, metavar="DIR", help="folder for vectors.safetensors, vocab.json, vectors.txt")
    t.add_argument("--dim", type=int, default=100, metavar="N", help="vector size (default 100)")
    t.add_argument("--window", type=int, default=5, metavar="N",
                   help="largest window; each position draws one in 1..N (default 5)")
    t.add_argument("--negative", type=int, default=5, metavar="N", help="noise words per pair (0: none; default 5)")
    t.add_argument("--min-count", type=int, default=5, metavar="N", help="drop words seen fewer times (default 5)")
    t.add_argument("--sample", type=float, default=1e-3, metavar="X",
                   help="subsampling threshold t (0: keep all; default 1e-3)")
    t.add_argument("--epochs", type=int, default=5, metavar="N", help="passes over the corpus (default 5)")
    t.add_argument("--alpha", type=float, default=0.025, metavar="X",
                   help="initial learning rate, decaying linearly (default 0.025)")
    kind = t.add_mutually_exclusive_group()
    kind.add_argument("--sg", dest="sg", action="store_true", default=True, help="skip-gram (the default)")
    kind.add_argument("--cbow", dest="sg", action="store_false", help="CBOW: predict a word from its window's mean")
    t.add_argument("--hs", action="store_true", help="hierarchical softmax (with --negative 0 alone, else with it; default: off)")
    t.add_argument("--seed", type=int, default=1, metavar="N", help="random seed (default 1, as gensim's)")
    t.add_argument("--threads", type=int, default=2, metavar="N", help="worker threads (default 2)")
    t.set_defaults(func=run_train)
    s = add_command(sub, "similar", help="nearest words, or a : b :: c : ? with --analogy",
                    description="The words nearest (by cosine) to the mean of the given words, or with --analogy the "
                                "answers w of a : b :: c : w.", example_lines=(
                        "lmkit embed similar --vectors vectors/ list",
                        "lmkit embed similar --vectors vectors/ --analogy list append dict --k 5"))
    s.add_argument("--vectors", required=True, metavar="DIR", help="a folder from `lmkit embed train`, or a word2vec text file")
    s.add_argument("words", nargs="+", metavar="WORD", help="words whose mean to search near (three with --analogy)")
    s.add_argument("--analogy", action="store_true", help="a b c: the words w with b - a + c nearest (3CosAdd; default: "
                   "nearest words)")
    s.add_argument("--k", type=int, default=10, dest="topn", metavar="K", help="words to print (default 10)")
    hidden_alias(s, "--topn", dest="topn", type=int)
    s.set_defaults(func=run_similar)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_train(args: argparse.Namespace) -> int:
    from lmkit.embed import Word2Vec, Word2VecConfig, sentences_of
    from lmkit.embed.vectors import TEXT_FILE, VECTORS_FILE, VOCAB_FILE

    refuse_output_folder(args.corpus, "--out", args.out, [VECTORS_FILE, VOCAB_FILE, TEXT_FILE])
    cfg = Word2VecConfig(dim=args.dim, window=args.window, negative=args.negative, hs=args.hs, sg=args.sg,
                         min_count=args.min_count, sample=args.sample, epochs=args.epochs, alpha=args.alpha,
                         seed=args.seed, threads=args.threads)
    cfg.check()
    from lmkit.progress import progress_bar

    sentences = list(sentences_of(load_corpus(args.corpus).texts()))
    with progress_bar(desc="word2vec", unit="word", unit_scale=True, dynamic_ncols=True) as bar:  # stderr, terminal only

        def progress(done: int, total: int, lr: float) -> None:
            bar.total = total
            bar.update(done - bar.n)

        vectors, report = Word2Vec(cfg).train(sentences, progress=progress)
    vectors.save(args.out)
    print(f"{len(vectors)} words x {vectors.dim} dims, {report.words:,} words trained in {report.seconds:.1f} s "
          f"({report.words_per_second:,.0f} words/s); wrote {args.out}")
    return 0


def run_similar(args: argparse.Namespace) -> int:
    from lmkit.embed import WordVectors

    vectors = WordVectors.load(args.vectors)
    missing = [w for w in args.words if w not in vectors]
    if missing:
        raise ConfigError(f"not in the vocabulary: {' '.join(missing)}; pick words the vectors know")
    if args.analogy:
        if len(args.words) != 3:
            raise ConfigError("--analogy takes three words a b c (a : b :: c : ?)")
        found = vectors.analogy(*args.words, topn=args.topn)
    else:
        found = vectors.most_similar(positive=args.words, topn=args.topn)
    for word, score in found:
        print(f"{score:.4f}  {word}")
    return 0
