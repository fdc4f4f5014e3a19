"""`lmkit search`: semantic search over a corpus's paragraphs with a sentence-transformers model (top k by cosine)."""
from __future__ import annotations

import argparse
import hashlib
import json

from lmkit.cli import utf8
from lmkit.cli.helptext import add_command, hidden_alias
from lmkit.cli.common import add_device_argument, device_of
from lmkit.data import load_corpus
from lmkit.data.cache import cache_dir
from lmkit.errors import ConfigError, CorpusError


def register(subparsers) -> None:
    p = add_command(subparsers, "search", help="semantic search over corpus paragraphs", description=__doc__,
                    example_lines=("lmkit search --model all-MiniLM-L6-v2 --query 'read a file line by line'",
                                   "lmkit search --model all-MiniLM-L6-v2 --query 'sort a dict' 'parse JSON' --k 3 --json"))
    p.add_argument("--model", required=True, metavar="DIR", help="sentence-transformers folder (e.g. all-MiniLM-L6-v2)")
    p.add_argument("--query", required=True, nargs="+", metavar="TEXT", help="one or more queries")
    p.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="built-in corpus or text files (default: pydocs)")
    p.add_argument("--k", type=int, default=5, metavar="K", dest="top_k", help="passages to show per query (default 5)")
    hidden_alias(p, "--top-k", dest="top_k", type=int)
    p.add_argument("--min-chars", type=int, default=40, metavar="N", help="shortest paragraph indexed (default 40)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="paragraphs per batch (default 64)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="encoder compute type; bf16 is faster, its cosines within ~1e-4 (default fp32)")
    hidden_alias(p, "--bf16", dest="precision", action="store_const", const="bf16")
    p.add_argument("--no-cache", action="store_true",
                   help="re-embed the paragraphs instead of reusing the cache (reused by default)")
    p.add_argument("--json", action="store_true", help="print results as JSON lines (default: a readable list)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from lmkit.search import SemanticIndex, paragraphs
    from lmkit.sentence import SentenceEncoder

    for query in args.query:
        utf8(query, "--query")
    if args.top_k < 1:
        raise ConfigError(f"--k must be at least 1, got {args.top_k}")
    bf16 = args.precision == "bf16"
    encoder = SentenceEncoder.from_pretrained(args.model, dtype=torch.bfloat16 if bf16 else None,
                                              device=device_of(args))
    corpus = load_corpus(args.corpus)
    # every weight and setting of the model (pooling, Dense, prompts, tokenizer) keys the cached embeddings
    files = sorted(f for f in Path(args.model).rglob("*") if f.suffix in (".safetensors", ".json"))
    key = json.dumps([str(Path(args.model).resolve()), [(str(f), f.stat().st_mtime_ns) for f in files],
                      corpus.fingerprint(), args.min_chars, bf16])
    folder = cache_dir("search", hashlib.sha256(key.encode()).hexdigest()[:16])
    if not args.no_cache and (folder / "passages.json").is_file():
        index = SemanticIndex.load(encoder, folder)
    else:
        passages, ids = paragraphs(corpus, args.min_chars)
        index = SemanticIndex.build(encoder, passages, ids, batch_size=args.batch_size, show_progress_bar=True)
        if index.passages:
            index.save(folder)
    if not index.passages:  # every query would answer nothing, as if nothing matched
        raise CorpusError(f"no paragraph of {' '.join(args.corpus)} has {args.min_chars} characters or more; "
                          "lower --min-chars")
    for query in args.query:
        hits = index.search(query, args.top_k)
        if args.json:
            print(json.dumps({"query": query, "hits": [{"score": s, "id": i, "text": t} for s, i, t in hits]}))
            continue
        print(f"query: {query}")
        for rank, (score, pid, text) in enumerate(hits, 1):
            print(f"  {rank}. {score:.4f}  {pid}  {text[:160]}{'...' if len(text) > 160 else ''}")
    return 0
