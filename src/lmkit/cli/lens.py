"""`lmkit lens`: the logit lens of a causal model on a prompt, printed per layer and drawn as a PNG grid.

Each layer's residual stream goes through the model's final norm and output head; the printout gives the top
next tokens at every position, and the nearest input embedding of the last position's stream.
"""
from __future__ import annotations

import argparse

import lmkit
from lmkit.cli import utf8
from lmkit.cli.helptext import add_command, hidden_alias
from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import ConfigError
from lmkit.plots.lens import plot_lens


def register(subparsers) -> None:
    p = add_command(subparsers, "lens", help="logit lens: what each layer predicts", description=__doc__,
                    example_lines=("lmkit lens --model runs/demo --prompt 'Return the number of'",
                                   "lmkit lens --model runs/demo --prompt 'def main(' --k 10 --out main-lens.png"))
    add_arguments(p)
    p.add_argument("--k", type=int, default=5, dest="top", metavar="K",
                   help="tokens printed for the last position (default 5)")
    hidden_alias(p, "--top", dest="top", type=int)
    p.set_defaults(func=run)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a causal model folder (config.json, tokenizer.json)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text whose next tokens each layer predicts")
    p.add_argument("--out", default="lens.png", metavar="PNG", help="the grid picture (default lens.png; JSON beside it)")
    p.add_argument("--embeddings-row", action="store_true",
                   help="draw the embeddings row of a model whose output head is its input embedding (default: left "
                        "out, as it predicts each input token itself at about 1.0 and flattens the colour scale)")
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


def draw(reading, inputs, tok, out: str, model: str = "", prompt: str = "", embeddings_row: bool = False):
    """The lens grid PNG; a tied model's embeddings row is left out unless embeddings_row, and the title says so."""
    from lmkit.plots import model_name, quoted

    probs, ids = reading.top(1)
    tokens = [[tok.decode([int(i)]) for i in row[:, 0]] for row in ids]
    names, probs = list(reading.names), probs[:, :, 0].tolist()
    title = "logit lens" + (f" of {model_name(model)}" if model else "") + (f" on {quoted(prompt)}" if prompt else "")
    title += ": top next token per layer"
    if reading.tied and not embeddings_row:
        names, tokens, probs = names[1:], tokens[1:], probs[1:]
        title += ("\n(embeddings row left out: tied to the output head, it predicts the input token itself; "
                  "--embeddings-row draws it)")
    return plot_lens(names, inputs, tokens, probs, out, title)


def run(args: argparse.Namespace) -> int:
    reading, inputs, tok = read(args.model, args.prompt, device_of(args))
    probs, ids = reading.top(max(1, args.top))
    show = lambda i: repr(tok.decode([int(i)]))  # noqa: E731
    print("input:  " + " ".join(repr(t) for t in inputs))
    for l, name in enumerate(reading.names):
        last = ", ".join(f"{show(i)} {p:.3f}" for p, i in zip(probs[l, -1].tolist(), ids[l, -1].tolist()))
        print(f"{name:>11}: top-1 {' '.join(show(i) for i in ids[l, :, 0])} | last: {last} | "
              f"nearest input embedding {show(reading.nearest[l, -1])}")
    print(f"wrote {draw(reading, inputs, tok, args.out, args.model, args.prompt, args.embeddings_row)}")
    return 0
