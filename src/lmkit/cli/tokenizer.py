"""`lmkit tokenizer train|encode`: train a tokenizer on a corpus, or show how a text splits."""
from __future__ import annotations

import sys
import time

from lmkit.cli import utf8
from lmkit.cli.helptext import add_command
from lmkit.data import load_corpus
from lmkit.data.corpus import refuse_inputs


def register(subparsers) -> None:
    p = add_command(subparsers, "tokenizer", help="train a tokenizer, or show how text splits into tokens",
                    description=__doc__, example_lines=(
                        "lmkit tokenizer train --kind bpe --vocab-size 4096 --out tok.json",
                        "lmkit tokenizer encode --tokenizer runs/demo 'def main():'"))
    sub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    t = add_command(sub, "train", help="train a tokenizer and write its tokenizer.json",
                    description="Train a tokenizer on a corpus and write a tokenizer.json that lmkit.load_tokenizer "
                                "and the `tokenizers` library load.", example_lines=(
                        "lmkit tokenizer train --out tok.json                # byte-level BPE, 8192 ids, on pydocs",
                        "lmkit tokenizer train --kind wordpiece --vocab-size 4000 --corpus notes/ --out wp/",
                        "lmkit tokenizer train --kind bpe --pattern digits --vocab-size 1024 --out digits.json"))
    t.add_argument("--kind", default="bpe", choices=("bpe", "wordpiece", "unigram", "char", "word"),
                   help="bpe: byte-level (lossless), wordpiece: BERT-style, unigram: SentencePiece-style; default: bpe")
    t.add_argument("--vocab-size", type=int, default=8192, metavar="N", help="ids in the vocabulary (default 8192)")
    t.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl; default: pydocs")
    t.add_argument("--out", required=True, metavar="PATH", help="tokenizer.json path, or a folder to write it in")
    t.add_argument("--special-tokens", nargs="*", default=None, metavar="TOKEN",
                   help="special tokens (default per kind, e.g. [PAD] [UNK] [CLS] [SEP] [MASK] for wordpiece)")
    t.add_argument("--pattern", default="gpt2", choices=("gpt2", "gpt4", "digits", "code"),
                   help="BPE pre-tokenization regex (digits: gpt2's with each digit a token of its own; code: gpt2's "
                        "with runs of spaces and tabs kept whole, as GPT-NeoX and StarCoder vocabularies hold "
                        "indentation; default: gpt2)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (one is drawn on a terminal by default)")
    t.set_defaults(func=run_train)
    e = add_command(sub, "encode", help="print the tokens and ids of a text", description="Print the tokens and ids of "
                    "a text.", example_lines=("lmkit tokenizer encode --tokenizer runs/demo 'Return the number of'",
                                              "echo 'x = 1' | lmkit tokenizer encode --tokenizer tok.json"))
    e.add_argument("--tokenizer", required=True, metavar="PATH", help="tokenizer.json or a folder holding one")
    e.add_argument("text", nargs="*", metavar="TEXT", help="text to encode (default: read stdin)")
    e.add_argument("--no-special-tokens", action="store_true", help="do not add [CLS]/[SEP]-style tokens (added by default)")
    e.set_defaults(func=run_encode)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_train(args) -> int:
    from pathlib import Path

    from lmkit.tokenizers import train_tokenizer

    out = Path(args.out)
    refuse_inputs(args.corpus, {"--out": out / "tokenizer.json" if out.is_dir() else out})
    texts = load_corpus(args.corpus).texts()
    start = time.perf_counter()
    tok = train_tokenizer(texts, kind=args.kind, vocab_size=args.vocab_size, special_tokens=args.special_tokens,
                          pattern=args.pattern, show_progress=not args.no_progress)
    seconds = time.perf_counter() - start
    path = tok.save(args.out)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"trained {args.kind} tokenizer: {tok.vocab_size} ids on {mb:.1f} MB in {seconds:.1f} s -> {path}")
    return 0


def run_encode(args) -> int:
    from lmkit.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    if args.text:
        text = utf8(" ".join(args.text), "the text")
    else:  # decoded here: the locale's stdin decoder would raise, or keep bad bytes as surrogates
        text = utf8(sys.stdin.buffer.read().decode("utf-8", "surrogateescape"), "the text on stdin")
    ids = tok.encode(text, add_special_tokens=not args.no_special_tokens)
    tokens = [tok.id_to_token(i) for i in ids]
    print(" | ".join(tokens))
    print(" ".join(map(str, ids)))
    print(f"{len(ids)} tokens, {len(text.encode('utf-8'))} bytes, "
          f"{len(text.encode('utf-8')) / max(1, len(ids)):.2f} bytes/token")
    return 0
