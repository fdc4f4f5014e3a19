"""`lmkit rag`: index documents with a sentence encoder, retrieve chunks, answer a question from them.

  lmkit rag index  --encoder DIR --corpus NAME|PATH ... --out INDEX [--chunk-tokens N --overlap N] [--limit N]
  lmkit rag remove --index INDEX --source ID ...
  lmkit rag query  --index INDEX --query TEXT [--k 5] [--mode dense|bm25|hybrid] [--json]
  lmkit rag ask    --index INDEX --model DIR --question TEXT [--k 5] [--allow-ungrounded]

`index` into an existing INDEX updates it in place: new documents are added, documents whose text
changed are replaced, unchanged ones are skipped (nothing is embedded twice).
"""
from __future__ import annotations

import argparse
import json

from lmkit.cli import utf8
from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.data import load_corpus
from lmkit.errors import ConfigError, CorpusError


def register(subparsers) -> None:
    p = add_command(subparsers, "rag", help="retrieval: index documents, query them, answer from them",
                    description=__doc__, example_lines=(
                        "lmkit rag index --encoder all-MiniLM-L6-v2 --corpus pydocs --limit 100 --out pyidx",
                        "lmkit rag query --index pyidx --query 'open a file for appending'",
                        "lmkit rag ask --index pyidx --model runs/demo/sft --question 'How do I sort a list?'"))
    sub = p.add_subparsers(dest="rag_command", metavar="ACTION", required=True)

    ix = add_command(sub, "index", help="chunk, embed and index documents (adds to an existing index)",
                     description="Chunk documents into overlapping pieces of the encoder's tokens, embed them and "
                                 "index them for dense (faiss) and BM25 search. Into an existing INDEX: new documents "
                                 "are added, changed ones replaced, unchanged ones skipped.", example_lines=(
                         "lmkit rag index --encoder all-MiniLM-L6-v2 --corpus pydocs --limit 100 --out pyidx",
                         "lmkit rag index --encoder all-MiniLM-L6-v2 --corpus notes/ --out notes-idx --chunk-tokens 256"))
    ix.add_argument("--encoder", required=True, metavar="DIR", help="sentence-transformers folder (e.g. all-MiniLM-L6-v2)")
    ix.add_argument("--corpus", nargs="+", required=True, metavar="NAME|PATH",
                    help="built-in corpus (pydocs: 722 documents, pycode) or text files, folders, globs, .jsonl")
    ix.add_argument("--limit", type=int, metavar="N",
                    help="index only the first N documents of --corpus (default: all); a later run with a larger N "
                         "adds the rest")
    ix.add_argument("--out", required=True, metavar="INDEX", help="index folder (created, or updated in place)")
    ix.add_argument("--chunk-tokens", type=int, default=None, metavar="N", help="encoder tokens per chunk (default 128)")
    ix.add_argument("--overlap", type=int, default=None, metavar="N", help="tokens shared by neighbouring chunks (default 16)")
    ix.add_argument("--approximate-above", type=int, default=None, metavar="N",
                    help="past N chunks use an IVF index instead of exact search (default 200000)")
    ix.add_argument("--batch-size", type=int, default=64, metavar="N", help="chunks per encoder batch (default 64)")
    ix.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="encoder compute type (default: bf16 where the device has native bf16, else fp32)")
    add_device_argument(ix)
    ix.set_defaults(func=run_index)

    rm = add_command(sub, "remove", help="remove documents from an index",
                     description="Remove documents (and all their chunks) from an index, in place.",
                     example_lines=("lmkit rag remove --index notes-idx --source notes/old.txt",))
    rm.add_argument("--index", required=True, metavar="INDEX", help="an `lmkit rag index` folder")
    rm.add_argument("--source", nargs="+", required=True, metavar="ID", help="document ids to remove")
    rm.set_defaults(func=run_remove)

    q = add_command(sub, "query", help="print the chunks that best match a query",
                    description="Print the chunks of an index that best match a query, best first.", example_lines=(
                        "lmkit rag query --index pyidx --query 'open a file for appending'",
                        "lmkit rag query --index pyidx --query 'itertools.groupby' --k 3 --mode bm25 --json"))
    q.add_argument("--index", required=True, metavar="INDEX", help="an `lmkit rag index` folder")
    q.add_argument("--query", required=True, metavar="TEXT", help="what to look for")
    q.add_argument("--k", type=int, default=5, metavar="K", help="chunks to return (default 5)")
    q.add_argument("--mode", choices=("dense", "bm25", "hybrid"), default="hybrid",
                   help="dense cosine, BM25, or both fused by reciprocal rank (default: hybrid)")
    add_device_argument(q)
    q.add_argument("--json", action="store_true",
                   help='one JSON list, best first: [{"source", "score", "text"}] (default: a readable list)')
    q.set_defaults(func=run_query)

    a = add_command(sub, "ask", help="answer a question from retrieved, numbered sources",
                    description="Retrieve the chunks that best match a question, put them in the prompt as numbered "
                                "sources, and have a model answer from them, citing [n].", example_lines=(
                        "lmkit rag ask --index pyidx --model runs/demo/sft --question 'How do I sort a list?'",
                        "lmkit rag ask --index pyidx --model runs/demo/sft --question 'What is a set?' --k 2 "
                        "--show-prompt"))
    a.add_argument("--index", required=True, metavar="INDEX", help="an `lmkit rag index` folder")
    a.add_argument("--model", required=True, metavar="DIR", help="decoder folder (its chat template is used if it has one)")
    a.add_argument("--question", required=True, metavar="TEXT", help="the question to answer")
    a.add_argument("--k", type=int, default=5, metavar="K", help="chunks to put in the prompt (default 5)")
    a.add_argument("--mode", choices=("dense", "bm25", "hybrid"), default="hybrid",
                   help="retrieval as in `rag query`: dense cosine, BM25, or both fused by reciprocal rank "
                        "(default: hybrid)")
    a.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="answer tokens, kept free of the context (default 128, or a quarter of the model's context "
                        "when that is less)")
    a.add_argument("--allow-ungrounded", action="store_true",
                   help="when no retrieved source fits the context, answer the bare question marked ungrounded "
                        "(default: refuse with an error naming the room)")
    a.add_argument("--show-prompt", action="store_true",
                   help="print the grounded prompt before the answer (default: the answer and sources only)")
    add_device_argument(a)
    a.set_defaults(func=run_ask)


def _dtype(precision: str | None, device):
    import torch

    from lmkit.train.config import default_precision

    return torch.bfloat16 if (precision or default_precision(device)) == "bf16" else None


def _require_extra() -> None:
    """faiss and bm25s, checked before any work (an index built for minutes, then a missing module, is worse)."""
    from lmkit.extras import require

    for module in ("faiss", "bm25s"):
        require(module, "lmkit rag")


def run_index(args: argparse.Namespace) -> int:
    _require_extra()
    import sys
    from pathlib import Path

    from lmkit.rag.store import APPROXIMATE_ABOVE, RagIndex

    corpus = load_corpus(args.corpus)
    if args.limit is not None:
        if args.limit < 1:
            raise ConfigError(f"--limit must be at least 1, got {args.limit}")
        corpus.documents = corpus.documents[:args.limit]
    if args.approximate_above is not None and args.approximate_above < 1:
        raise ConfigError(f"--approximate-above must be at least 1, got {args.approximate_above}")
    out, device = Path(args.out), device_of(args)
    if (out / "manifest.json").is_file():
        index = RagIndex.open(out, args.encoder, dtype=_dtype(args.precision, device), device=device)
        for flag, key in (("--chunk-tokens", "chunk_tokens"), ("--overlap", "overlap")):
            given = getattr(args, key)
            if given is not None and given != index.settings[key]:
                raise ConfigError(f"{out} was chunked with {flag} {index.settings[key]}; use that, or index into a "
                                  "new folder")
        if args.approximate_above is not None:
            index.settings["approximate_above"] = args.approximate_above
    else:
        index = RagIndex.create(args.encoder, 128 if args.chunk_tokens is None else args.chunk_tokens,
                                16 if args.overlap is None else args.overlap,
                                args.approximate_above or APPROXIMATE_ABOVE, dtype=_dtype(args.precision, device),
                                batch_size=args.batch_size, device=device)
    print(f"lmkit rag index: {len(corpus)} documents of {' '.join(args.corpus)} into {out}", file=sys.stderr)
    counts = index.add(corpus, progress=True)
    if not len(index):

        raise CorpusError(f"{' '.join(args.corpus)} gave no chunk to index (only blank text); give documents with text")
    index.save(out)
    kind = "IVF (approximate)" if index.approximate else "exact inner product"
    print(f"{out}: {len(index)} chunks of {len(index.documents)} documents ({kind}); {counts['added']} added, "
          f"{counts['replaced']} replaced, {counts['unchanged']} unchanged, {counts['chunks']} chunks embedded",
          file=sys.stderr)
    return 0


def run_remove(args: argparse.Namespace) -> int:
    _require_extra()
    import sys

    from lmkit.rag.store import RagIndex

    index = RagIndex.open(args.index)
    removed = index.remove(args.source)
    index.save(args.index)
    print(f"{args.index}: removed {len(args.source)} documents ({removed} chunks); {len(index)} chunks left",
          file=sys.stderr)
    return 0


def run_query(args: argparse.Namespace) -> int:
    _require_extra()
    from lmkit.rag.retrieve import retrieve
    from lmkit.rag.store import RagIndex

    utf8(args.query, "--query")
    hits = retrieve(RagIndex.open(args.index, device=device_of(args)), args.query, args.k, args.mode)
    if args.json:
        print(json.dumps([h.to_json() for h in hits], ensure_ascii=False))
        return 0
    for rank, h in enumerate(hits, 1):
        text = " ".join(h.text.split())
        print(f"{rank}. {h.score:.4f}  {h.source}#{h.n}  {text[:200]}{'...' if len(text) > 200 else ''}")
    return 0


def run_ask(args: argparse.Namespace) -> int:
    _require_extra()
    from lmkit.rag.answer import answer
    from lmkit.rag.store import RagIndex

    utf8(args.question, "--question")
    device = device_of(args)  # the question's encoder and the answering decoder both run there
    result = answer(RagIndex.open(args.index, device=device), args.model, args.question, k=args.k, mode=args.mode,
                    max_new_tokens=args.max_new_tokens, allow_ungrounded=args.allow_ungrounded, device=device)
    import sys

    for notice in result.notices:
        print(f"lmkit: {notice}", file=sys.stderr)
    if args.show_prompt:
        print(result.prompt)
        print("---")
    print(result.answer)
    print()
    if not result.grounded:
        print("sources: none (ungrounded answer: not drawn from the index)")
        return 0
    print("sources:")
    for number, hit in enumerate(result.sources, 1):
        mark = "*" if number in result.cited else " "
        print(f" {mark}[{number}] {hit.source}#{hit.n}  score {hit.score:.4f}")
    return 0
