"""`lmkit plot`: pictures of the math as PNG (with their numbers as JSON beside them).

  positions    the sinusoidal encoding heatmap and RoPE's q.k against the offset m - n
  attention    attention maps per layer and head of a model on a text (PNG grid and an offline HTML viewer)
  embeddings   2-D PCA of a model's token embeddings or of word vectors, labelled
  lens         the logit-lens grid of a causal model on a prompt
"""
from __future__ import annotations

import argparse

import lmkit
from lmkit.cli import utf8
from lmkit.cli.helptext import add_command, hidden_alias, old_spellings
from lmkit.cli.lens import add_arguments, draw, read
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = add_command(subparsers, "plot", help="pictures: positions, attention, embeddings, lens", description=__doc__,
                    example_lines=("lmkit plot positions", "lmkit plot attention --model runs/demo --prompt 'def f(x):'"))
    sub = p.add_subparsers(dest="plot_command", metavar="PICTURE")
    pos = add_command(sub, "positions", help="sinusoidal heatmap and RoPE score against the offset",
                      description="The sinusoidal position encoding as a heatmap (position x dimension), and RoPE's "
                                  "q.k against the offset m - n at two key positions: the curves coincide, since "
                                  "RoPE scores depend only on the offset.", example_lines=(
                          "lmkit plot positions", "lmkit plot positions --positions 512 --dim 64 --out pos.png"))
    pos.add_argument("--out", default="positions.png", metavar="PNG", help="the picture; the numbers go to a JSON file beside it")
    pos.add_argument("--positions", type=int, default=128, metavar="N", help="positions (rows) of the heatmap")
    pos.add_argument("--dim", type=int, default=128, metavar="N", help="encoding dimensions (columns), an even number")
    pos.add_argument("--base", type=float, default=10000.0, metavar="X",
                     help="wavelength base of the sinusoids, as in Vaswani et al.")
    pos.set_defaults(func=run_positions)
    att = add_command(sub, "attention", help="attention maps per layer and head",
                      description="The attention probabilities of every layer and head of a model on a text, as a "
                                  "PNG grid and an offline HTML viewer (query rows, key columns).", example_lines=(
                          "lmkit plot attention --model runs/demo --prompt 'def add(a, b): return a + b'",
                          "lmkit plot attention --model runs/demo --prompt 'x = 1' --layers 1 2 --heads 1 --out a.png"))
    att.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, weights, tokenizer)")
    old_spellings(att.add_argument("--prompt", "--text", dest="text", required=True, metavar="TEXT",
                                   help="the text the model reads"), "--text")
    att.add_argument("--out", default="attention.png", metavar="PNG", help="the grid picture")
    att.add_argument("--html", default=None, metavar="FILE", help="the offline viewer (default: the PNG's name, .html)")
    att.add_argument("--layers", type=int, nargs="+", metavar="N", help="only these attention layers (1 = the first; all by default)")
    att.add_argument("--heads", type=int, nargs="+", metavar="H", help="only these heads (1 = the first; all by default)")
    att.set_defaults(func=run_attention)
    emb = add_command(sub, "embeddings", help="2-D PCA of token embeddings or word vectors",
                      description="The first two principal components of a model's input token embeddings, or of "
                                  "word vectors, each point labelled.", example_lines=(
                          "lmkit plot embeddings --model runs/demo",
                          "lmkit plot embeddings --vectors vectors/ --words list dict tuple set int str"))
    src = emb.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a model folder: its input token embeddings")
    src.add_argument("--vectors", metavar="DIR", help="word vectors from `lmkit embed train`, or a word2vec text file")
    emb.add_argument("--words", nargs="+", metavar="WORD", help="the words or tokens to show (default: the first --k)")
    emb.add_argument("--k", type=int, default=100, dest="count", metavar="K",
                     help="how many to show without --words (default 100)")
    hidden_alias(emb, "--count", dest="count", type=int)
    emb.add_argument("--out", default="embeddings.png", metavar="PNG", help="the picture")
    emb.set_defaults(func=run_embeddings)
    lens = add_command(sub, "lens", help="the logit-lens grid",
                       description="The logit-lens grid of a causal model on a prompt: each layer's top next token "
                                   "at each position, coloured by its probability (`lmkit lens` prints it too).",
                       example_lines=("lmkit plot lens --model runs/demo --prompt 'Return the number of'",))

    add_arguments(lens)
    lens.set_defaults(func=run_lens)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_positions(args: argparse.Namespace) -> int:
    from lmkit.plots.positions import plot_positions

    if args.positions < 1 or args.dim < 2 or args.dim % 2:
        raise ConfigError("--positions must be >= 1 and --dim an even number >= 2")
    print(f"wrote {plot_positions(args.out, args.positions, args.dim, args.base)}")
    return 0


def run_attention(args: argparse.Namespace) -> int:
    import torch
    from pathlib import Path

    from lmkit.attention_maps import attention_maps
    from lmkit.plots.attention import attention_html, plot_attention_grid

    utf8(args.text, "--prompt")
    model = lmkit.load_model(args.model)
    tok = lmkit.load_tokenizer(args.model)
    ids = tok.encode(args.text)
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    input_ids = torch.tensor([ids])
    maps = attention_maps(model, input_ids)
    tokens = [tok.decode([i]) for i in ids]
    start = getattr(model.config, "decoder_start_token_id", None) or 0
    decoder_tokens = [tok.decode([start])] + tokens[:-1]  # what attention_maps feeds an encoder-decoder's decoder
    seq2seq = hasattr(model, "encoder") and hasattr(model, "decoder")

    def axes(label: str) -> tuple[list[str], list[str]]:
        if not seq2seq or not label.startswith("decoder"):
            return tokens, tokens
        return decoder_tokens, tokens if label.endswith(" cross") else decoder_tokens

    arrays = {l: m[0].float().numpy() for l, m in maps.items()}
    arrays = {l: arrays[l] for l in select(list(arrays), args.layers, "--layers")}
    if args.heads:
        n_heads = min(a.shape[0] for a in arrays.values())
        heads = [h - 1 for h in select(list(range(1, n_heads + 1)), args.heads, "--heads")]
        arrays = {l: a[heads] for l, a in arrays.items()}
    labels = {l: axes(l) for l in arrays}
    name = Path(args.model).resolve().name
    png = plot_attention_grid(arrays, labels, args.out, title=f"attention of {name}")
    page = attention_html(arrays, labels, args.html or Path(args.out).with_suffix(".html"), title=f"attention of {name}")
    print(f"wrote {png} and {page}")
    return 0


def select(items: list, numbers: list[int] | None, flag: str) -> list:
    """items[n - 1] for each 1-based n (all items when numbers is None)."""

    if not numbers:
        return items
    bad = [n for n in numbers if not 1 <= n <= len(items)]
    if bad:
        raise ConfigError(f"{flag} {' '.join(map(str, bad))}: choose numbers from 1 to {len(items)}")
    return [items[n - 1] for n in numbers]


def run_embeddings(args: argparse.Namespace) -> int:
    from lmkit.plots.embeddings import plot_embeddings

    if args.vectors:
        from lmkit.embed import WordVectors

        vectors = WordVectors.load(args.vectors)
        labels = args.words or vectors.words[:args.count]
        missing = [w for w in labels if w not in vectors]
        if missing:
            raise ConfigError(f"not in the vocabulary: {' '.join(missing)}")
        matrix = vectors.vectors[[vectors.index[w] for w in labels]]
    else:

        model = lmkit.load_model(args.model)
        tok = lmkit.load_tokenizer(args.model)
        E = model.get_input_embeddings().weight.detach().float().numpy()
        if args.words:
            ids = [tok.encode(w, add_special_tokens=False) for w in args.words]
            bad = [w for w, i in zip(args.words, ids) if len(i) != 1]
            if bad:
                raise ConfigError(f"not single tokens of this tokenizer: {' '.join(bad)}; give words it keeps whole")
            ids = [i[0] for i in ids]
        else:
            ids = list(range(min(args.count, E.shape[0])))
        labels = [tok.decode([i]) for i in ids]
        matrix = E[ids]
    if len(labels) < 2:
        raise ConfigError("a PCA needs at least two vectors; give more --words or a larger --count")
    print(f"wrote {plot_embeddings(labels, matrix, args.out)}")
    return 0


def run_lens(args: argparse.Namespace) -> int:
    reading, inputs, tok = read(args.model, args.prompt)
    print(f"wrote {draw(reading, inputs, tok, args.out)}")
    return 0
