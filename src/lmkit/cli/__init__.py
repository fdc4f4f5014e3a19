"""The `lmkit` command: one subcommand per job, each a thin module over the library.

Each module in `SUBCOMMANDS` exposes `register(subparsers)`, which adds its parser and sets
`func` to a callable taking the parsed arguments and returning an exit status.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from lmkit import __version__
from lmkit.cli.common import device_of
from lmkit.errors import LmkitError, user_message
from lmkit.extras import missing_extra

SUBCOMMANDS = ("train", "generate", "evaluate", "tokenizer", "demo", "data", "distill", "prune", "quantize",
               "finetune", "search", "chat", "serve", "harness", "rag", "embed", "lens", "plot", "scaling",
               "code")


def build_parser() -> argparse.ArgumentParser:
    from lmkit.cli.helptext import Formatter, examples

    parser = argparse.ArgumentParser(
        prog="lmkit", formatter_class=Formatter,
        description="Build, train, evaluate and run transformer language models. `lmkit COMMAND --help` describes "
                    "each command, with examples.",
        epilog=examples("lmkit demo                                   # train, tune and chat in about 8 minutes",
                        "lmkit train --preset tiny --max-steps 200    # a small model on pydocs in runs/tiny",
                        "lmkit generate --model runs/tiny --prompt 'def main('"))
    parser.add_argument("--version", action="version", version=f"lmkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"lmkit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"lmkit.cli.{name}":
                continue  # a subcommand not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # imports every subcommand (torch included): seconds in which Ctrl-C is likely
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("lmkit: interrupted", file=sys.stderr)
        return 130
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "device", None) is not None:  # one line and exit 2 for a device not there, before any work
            args.device = device_of(args)
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (`lmkit eval ... | head -1`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not raise again
        return 141
    except ModuleNotFoundError as exc:  # an optional extra not installed: which one to install, in one line
        missing = missing_extra(exc, f"lmkit {args.command}")
        if missing is None:
            raise
        print(f"lmkit: error: {missing}", file=sys.stderr)
        return 2
    except (LmkitError, OSError) as exc:
        message = user_message(exc)
        if message is None:  # an OSError not about a path the user named: a bug
            raise
        print(f"lmkit: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmkit: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as exc:
        size = out_of_memory(exc)
        if size is None:
            raise
        print(f"lmkit: error: out of memory{size}; lower --batch-size (or set --micro-batch-size), --seq-len, "
              "--num-beams or --num-return-sequences", file=sys.stderr)
        return 2


def utf8(text: str, what: str) -> str:
    """`text` from the command line or stdin, refused when it was not UTF-8 (Python keeps such bytes as
    lone surrogates, which every encoder would fail on or turn into U+FFFD)."""

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"code point U+{bad:04X}"
        raise LmkitError(f"{what} is not UTF-8 ({byte} at character {exc.start}); give UTF-8 text "
                         "(convert it with iconv, or set a UTF-8 locale)") from None
    return text


def out_of_memory(exc: BaseException) -> str | None:
    """' (tried to allocate N ...)' when exc is an allocation failure (CPU, CUDA, numpy), else None."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in text):
        return None
    size = re.search(r"[Tt]ried to allocate ([\d.]+ ?[A-Za-z]+)", text)
    return f" (tried to allocate {size.group(1)})" if size else ""
