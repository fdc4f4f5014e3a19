"""`lmkit lens`: the logit lens of a causal model on a prompt, printed per layer and drawn as a PNG grid.

Each layer's residual stream goes through the model's final norm and output head; the printout gives the top
next tokens at every position, and the nearest input embedding of the last position's stream.
"""
from __future__ import annotations

import argparse

import lmkit
from lmkit.cli import utf8
from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import ConfigError
from lmkit.plots.lens import plot_lens


def register(subparsers) -> None:
    p = subparsers.add_parser("lens", help="logit lens: what each layer predicts", description=__doc__)
    add_arguments(p)
    p.add_argument("--top", type=int, default=5, metavar="K", help="tokens printed for the last position (default 5)")
    p.set_defaults(func=run)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a causal model folder (config.json, tokenizer.json)")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--out", default="lens.png", metavar="PNG", help="the grid picture (default lens.png; JSON beside it)")
    add_device_argument(p)


def read(model_dir: str, prompt: str, device=None):
    """(reading, token strings of the prompt, tokenizer) for the prompt through the model at model_dir, on
    `device` (None: the CPU)."""
    import torch

    from lmkit.lens import logit_lens

    utf8(prompt, "--prompt")
    model = lmkit.load_model(model_dir, device=device)
    tok = lmkit.load_tokenizer(model_dir)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    reading = logit_lens(model, torch.tensor(ids))
    return reading, [tok.decode([i]) for i in ids], tok


def draw(reading, inputs, tok, out: str):
    probs, ids = reading.top(1)
    tokens = [[tok.decode([int(i)]) for i in row[:, 0]] for row in ids]
    return plot_lens(reading.names, inputs, tokens, probs[:, :, 0].tolist(), out)


def run(args: argparse.Namespace) -> int:
    reading, inputs, tok = read(args.model, args.prompt, device_of(args))
    probs, ids = reading.top(max(1, args.top))
    show = lambda i: repr(tok.decode([int(i)]))  # noqa: E731
    print("input:  " + " ".join(repr(t) for t in inputs))
    for l, name in enumerate(reading.names):
        last = ", ".join(f"{show(i)} {p:.3f}" for p, i in zip(probs[l, -1].tolist(), ids[l, -1].tolist()))
        print(f"{name:>11}: top-1 {' '.join(show(i) for i in ids[l, :, 0])} | last: {last} | "
              f"nearest input embedding {show(reading.nearest[l, -1])}")
    print(f"wrote {draw(reading, inputs, tok, args.out)}")
    return 0
