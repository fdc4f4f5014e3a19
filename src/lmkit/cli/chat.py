"""`lmkit chat`: talk to a model with a chat template in the terminal. Replies stream as they are decoded.

Commands: /help, /reset (forget the conversation), /exit (or Ctrl-D); a line that starts with // sends the text
after the first slash. Ctrl-C stops the current reply and keeps the session. The history is kept within the
model's context: the oldest exchanges are dropped, with a notice.
"""
from __future__ import annotations

import argparse
import re
import sys

import lmkit
from lmkit.cli.common import add_device_argument, device_of
from lmkit.cli.generate import TerminalStreamer
from lmkit.cli.helptext import add_command
from lmkit.errors import GenerationError, LmkitError


def register(subparsers) -> None:
    p = add_command(subparsers, "chat", help="talk to a model with a chat template in the terminal", description=__doc__,
                    example_lines=("lmkit chat --model runs/demo/sft",
                                   "lmkit chat --model runs/demo/sft --system 'Answer in one sentence.' --temperature 0"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder with a chat template (e.g. from "
                   "`lmkit finetune --task sft`)")
    p.add_argument("--system", metavar="TEXT", help="system prompt, kept for the whole conversation (default: none)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature (default: the folder's generation_config.json, 0.7 after `finetune "
                        "--task sft`, else 1; 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling mass (default: the folder's generation_config.json, 0.9 after `finetune "
                        "--task sft`, else 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="longest reply in tokens (default 256, at most half the model's context)")
    p.add_argument("--seed", type=int, metavar="N", help="seed for sampling, for repeatable replies (default: a fresh "
                   "one each run)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lmkit.chat_session import ChatSession

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if (args.temperature is not None and args.temperature < 0) or (args.top_p is not None and not 0 < args.top_p <= 1):
        raise GenerationError("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tok = lmkit.load_model(args.model, device=device_of(args)), lmkit.load_tokenizer(args.model)
    session = ChatSession(model, tok, args.system, args.max_new_tokens, args.temperature, args.top_p)
    out = sys.stdout
    out.write(f"lmkit chat: {args.model} ({model.config.max_seq_len} positions, replies up to {session.max_new_tokens} "
              f"tokens, temperature {session.temperature:g}). /help, /reset, /exit; Ctrl-C stops a reply.\n")
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
        command = re.match(r"/([A-Za-z]+)(?:\s|$)", text)
        if command:
            name = command.group(1).lower()
            if name in ("exit", "quit"):
                return 0
            if name == "reset":
                session.reset()
                out.write("[conversation cleared]\n")
            elif name == "help":
                out.write(HELP)
            else:
                out.write(f"[unknown command /{name}; the commands are {', '.join(COMMANDS)} (//{name} sends "
                          f"/{name} to the model)]\n")
            out.flush()
            continue
        if line.lstrip().startswith("//"):  # the escape for a message that begins with a slash
            line = line.lstrip()[1:]
        try:
            session.send(line, _reply_streamer(tok, out), on_drop=lambda n: out.write(
                f"[dropped the oldest {'exchange' if n == 1 else f'{n} exchanges'} to fit the context]\n"))
        except KeyboardInterrupt:
            out.write("\n[reply stopped]\n")
        except LmkitError as exc:
            out.write(f"[{exc}]\n")
        out.flush()


COMMANDS = {"/help": "this list", "/reset": "forget the conversation (the system prompt stays)",
            "/exit": "leave (also /quit, or Ctrl-D)"}
HELP = ("".join(f"  {name:<7} {what}\n" for name, what in COMMANDS.items())
        + "  //TEXT  send TEXT starting with a slash\n  Ctrl-C  stop the current reply\n")


def _reply_streamer(tok, out):
    """The terminal streamer of `lmkit generate`, with the speaker's name where the prompt would be printed."""

    return TerminalStreamer(tok, "assistant> ", out)
