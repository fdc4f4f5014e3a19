"""`lmkit data`: prepare token shards (`prepare`), clean a corpus (`clean`), check shards (`verify`)."""
from __future__ import annotations

import argparse

from lmkit.cli.helptext import add_command


def register(subparsers) -> None:
    p = add_command(subparsers, "data", help="prepare, clean and verify training data", description=__doc__,
                    example_lines=("lmkit data clean --corpus notes/ --out notes.jsonl",
                                   "lmkit data prepare --corpus notes.jsonl --tokenizer tok.json --out shards/",
                                   "lmkit data verify shards/"))
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    prep = add_command(sub, "prepare", help="tokenize a corpus in parallel into memory-mapped shards",
                       description="Tokenize a corpus in parallel into memory-mapped shards; `lmkit train --data DIR` "
                                   "trains on them.", example_lines=(
                           "lmkit data prepare --corpus pydocs --tokenizer runs/demo --out shards/",
                           "lmkit data prepare --corpus 'books/*.txt' --tokenizer tok.json --out shards/ --workers 2"))
    prep.add_argument("--corpus", nargs="+", required=True, metavar="NAME|PATH",
                      help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl")
    prep.add_argument("--tokenizer", required=True, metavar="PATH", help="tokenizer.json, or a folder holding one")
    prep.add_argument("--out", required=True, metavar="DIR", help="folder for the shards and index.json")
    prep.add_argument("--workers", type=int, metavar="N", help="tokenizing processes (default: the CPU count)")
    prep.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                      help="share of documents (by id hash) in the validation split (default 0.05)")
    prep.add_argument("--shard-mb", type=float, default=16, metavar="MB", help="text per shard in MB (default 16)")
    prep.add_argument("--separator", default="<|endoftext|>", metavar="TOKEN",
                      help="special token put before every document (default <|endoftext|>)")
    prep.add_argument("--overwrite", action="store_true", help="replace shards already in --out (refused by default)")
    prep.set_defaults(func=run_prepare)

    cl = add_command(sub, "clean", help="remove duplicates, near duplicates, junk and boilerplate lines",
                     description="Remove exact duplicates, near duplicates (MinHash LSH over word shingles), junk "
                                 "documents (too short, too few letters, too many digits or broken characters) and "
                                 "boilerplate lines (lines repeated across many documents).", example_lines=(
                         "lmkit data clean --corpus notes/ --out clean.jsonl",
                         "lmkit data clean --corpus pages.jsonl --out clean.jsonl --min-words 20 --near-threshold 0.7"))
    cl.add_argument("--corpus", nargs="+", required=True, metavar="NAME|PATH",
                    help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl")
    cl.add_argument("--out", required=True, metavar="FILE.jsonl", help="cleaned corpus, one {\"id\", \"text\"} per line")
    cl.add_argument("--report", metavar="FILE.json", help="what was removed and why (default: OUT.report.json)")
    cl.add_argument("--min-chars", type=int, default=20, metavar="N", help="drop documents shorter than N characters")
    cl.add_argument("--max-chars", type=int, metavar="N", help="drop documents longer than N characters (default: no limit)")
    cl.add_argument("--min-words", type=int, default=3, metavar="N", help="drop documents of fewer than N words")
    cl.add_argument("--min-alpha", type=float, default=0.25, metavar="X",
                    help="least share of letters among non-space characters")
    cl.add_argument("--max-digit", type=float, default=0.5, metavar="X",
                    help="largest share of digits among non-space characters")
    cl.add_argument("--max-bad", type=float, default=0.001, metavar="X",
                    help="largest share of control/unassigned/U+FFFD characters")
    cl.add_argument("--languages", metavar="CODE[,CODE...]",
                    help="keep only documents in these languages (ISO 639-1, e.g. en,de; lingua detects them; "
                         "default: every language)")
    cl.add_argument("--boilerplate-min-docs", type=int, default=5, metavar="N",
                    help="a line in at least N documents is boilerplate; 0 keeps all lines")
    cl.add_argument("--boilerplate-min-chars", type=int, default=20, metavar="N",
                    help="only lines of at least N characters count as boilerplate")
    cl.add_argument("--near-threshold", type=float, default=0.8, metavar="X",
                    help="estimated Jaccard similarity of a near duplicate")
    cl.add_argument("--no-near-dedup", action="store_true", help="skip MinHash near-duplicate removal (done by default)")
    cl.add_argument("--shingle", type=int, default=5, metavar="N", help="words per shingle")
    cl.add_argument("--num-perm", type=int, default=128, metavar="N", help="MinHash permutations, a multiple of --bands")
    cl.add_argument("--bands", type=int, default=16, metavar="N", help="LSH bands the permutations are split into")
    cl.set_defaults(func=run_clean)

    ver = add_command(sub, "verify", help="check every shard against index.json (sizes, counts, sha256)",
                      description="Check every shard against index.json (sizes, counts, sha256).",
                      example_lines=("lmkit data verify shards/",))
    ver.add_argument("folder", metavar="DIR", help="a folder written by `lmkit data prepare`")
    ver.set_defaults(func=run_verify)


def _describe(index: dict) -> str:
    parts = [f"{name} {s['num_tokens']} tokens in {len(s['shards'])} shards ({s['num_documents']} documents)"
             for name, s in index["splits"].items()]
    return f"{index['dtype']} ids (vocab {index['vocab_size']}): " + "; ".join(parts)


def run_prepare(args: argparse.Namespace) -> int:
    from lmkit.data.prepare import prepare

    index = prepare(args.corpus, args.tokenizer, args.out, workers=args.workers, val_fraction=args.val_fraction,
                    shard_bytes=args.shard_mb * (1 << 20), separator=args.separator, overwrite=args.overwrite)
    print(f"lmkit data prepare: {_describe(index)}; wrote {args.out}")
    return 0


def run_clean(args: argparse.Namespace) -> int:
    from lmkit.data.clean import CleanConfig, clean_files
    from lmkit.data.language import parse_languages

    config = CleanConfig(languages=parse_languages(args.languages), min_chars=args.min_chars, max_chars=args.max_chars, min_words=args.min_words,
                         min_alpha=args.min_alpha, max_digit=args.max_digit, max_bad=args.max_bad,
                         boilerplate_min_docs=args.boilerplate_min_docs, boilerplate_min_chars=args.boilerplate_min_chars,
                         near_threshold=None if args.no_near_dedup else args.near_threshold, num_perm=args.num_perm,
                         bands=args.bands, shingle=args.shingle)
    report = clean_files(args.corpus, args.out, args.report, config)
    removed = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in report["removed"].items() if n) or "nothing"
    print(f"lmkit data clean: kept {report['documents_kept']} of {report['documents_in']} documents "
          f"(removed {removed}; {report['boilerplate']['lines_removed']} boilerplate lines); "
          f"wrote {args.out} and {args.report or args.out + '.report.json'}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from lmkit.data.prepare import verify

    index = verify(args.folder)
    print(f"lmkit data verify: {args.folder} is intact: {_describe(index)}")
    return 0
