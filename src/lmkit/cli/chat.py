"""`lmkit chat`: talk to a model with a chat template in the terminal. Replies stream as they are decoded.

Commands: /reset (forget the conversation), /exit (or Ctrl-D). Ctrl-C stops the current reply and keeps the session.
The history is kept within the model's context: the oldest exchanges are dropped, with a notice.
"""
from __future__ import annotations

import argparse
import sys

import lmkit
from lmkit.cli.common import add_device_argument, device_of
from lmkit.cli.generate import TerminalStreamer
from lmkit.errors import GenerationError, LmkitError


def register(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk to a model with a chat template in the terminal", description=__doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="model folder with a chat template (e.g. from "
                   "`lmkit finetune --task sft`)")
    p.add_argument("--system", metavar="TEXT", help="system prompt, kept for the whole conversation")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T", help="sampling temperature (default 0.7; 0: greedy)")
    p.add_argument("--top-p", type=float, default=0.9, metavar="P", help="nucleus sampling mass (default 0.9)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="longest reply in tokens (default 256, "
                   "within the model's context)")
    p.add_argument("--seed", type=int, metavar="N", help="seed for sampling (repeatable replies)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lmkit.chat_session import ChatSession

    if args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise GenerationError("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tok = lmkit.load_model(args.model, device=device_of(args)), lmkit.load_tokenizer(args.model)
    session = ChatSession(model, tok, args.system, args.max_new_tokens, args.temperature, args.top_p)
    out = sys.stdout
    out.write(f"lmkit chat: {args.model} ({model.config.max_seq_len} positions). /reset, /exit; Ctrl-C stops a reply.\n")
    out.flush()
    while True:
        try:
            line = input("you> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n(/exit to quit)\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            out.write("[conversation cleared]\n")
            continue
        try:
            session.send(line, _reply_streamer(tok, out), on_drop=lambda n: out.write(
                f"[dropped the oldest {'exchange' if n == 1 else f'{n} exchanges'} to fit the context]\n"))
        except KeyboardInterrupt:
            out.write("\n[reply stopped]\n")
        except LmkitError as exc:
            out.write(f"[{exc}]\n")
        out.flush()


def _reply_streamer(tok, out):
    """The terminal streamer of `lmkit generate`, with the speaker's name where the prompt would be printed."""

    return TerminalStreamer(tok, "assistant> ", out)
