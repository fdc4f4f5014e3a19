"""`lmkit plot`: pictures of the math as PNG (with their numbers as JSON beside them).

positions            the sinusoidal encoding heatmap and RoPE's q.k against the offset m - n
attention            attention maps per layer and head of a model on a text (PNG grid and an offline HTML viewer)
embeddings           2-D PCA of a model's token embeddings or of word vectors, labelled
lens                 the logit-lens grid of a causal model on a prompt
"""
from __future__ import annotations

import argparse

import lmkit
from lmkit.cli import utf8
from lmkit.cli.common import add_device_argument, device_of
from lmkit.cli.lens import add_arguments, draw, read
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="pictures: positions, attention, embeddings, lens", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="plot_command", metavar="PICTURE")
    pos = sub.add_parser("positions", help="sinusoidal heatmap and RoPE score against the offset")
    pos.add_argument("--out", default="positions.png", metavar="PNG")
    pos.add_argument("--positions", type=int, default=128)
    pos.add_argument("--dim", type=int, default=128)
    pos.add_argument("--base", type=float, default=10000.0)
    pos.set_defaults(func=run_positions)
    att = sub.add_parser("attention", help="attention maps per layer and head")
    att.add_argument("--model", required=True, metavar="DIR")
    att.add_argument("--text", required=True, metavar="TEXT")
    att.add_argument("--out", default="attention.png", metavar="PNG")
    att.add_argument("--html", default=None, metavar="FILE", help="the offline viewer (default: the PNG's name, .html)")
    att.add_argument("--layers", type=int, nargs="+", metavar="N", help="only these attention layers (1 = the first; all by default)")
    att.add_argument("--heads", type=int, nargs="+", metavar="H", help="only these heads (1 = the first; all by default)")
    add_device_argument(att)
    att.set_defaults(func=run_attention)
    emb = sub.add_parser("embeddings", help="2-D PCA of token embeddings or word vectors")
    src = emb.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a model folder: its input token embeddings")
    src.add_argument("--vectors", metavar="DIR", help="word vectors from `lmkit embed train`, or a word2vec text file")
    emb.add_argument("--words", nargs="+", metavar="WORD", help="the words or tokens to show (default: the first --count)")
    emb.add_argument("--count", type=int, default=100, help="how many to show without --words (default 100)")
    emb.add_argument("--out", default="embeddings.png", metavar="PNG")
    add_device_argument(emb)
    emb.set_defaults(func=run_embeddings)
    lens = sub.add_parser("lens", help="the logit-lens grid")

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

    utf8(args.text, "--text")
    model = lmkit.load_model(args.model, device=device_of(args))
    tok = lmkit.load_tokenizer(args.model)
    ids = tok.encode(args.text)
    if not ids:
        raise ConfigError("--text encodes to no tokens; give some text")
    input_ids = torch.tensor([ids], device=model.device)
    maps = attention_maps(model, input_ids)
    tokens = [tok.decode([i]) for i in ids]
    start = getattr(model.config, "decoder_start_token_id", None) or 0
    decoder_tokens = [tok.decode([start])] + tokens[:-1]  # what attention_maps feeds an encoder-decoder's decoder
    seq2seq = hasattr(model, "encoder") and hasattr(model, "decoder")

    def axes(label: str) -> tuple[list[str], list[str]]:
        if not seq2seq or not label.startswith("decoder"):
            return tokens, tokens
        return decoder_tokens, tokens if label.endswith(" cross") else decoder_tokens

    arrays = {l: m[0].float().cpu().numpy() for l, m in maps.items()}
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

        model = lmkit.load_model(args.model, device=device_of(args))
        tok = lmkit.load_tokenizer(args.model)
        E = model.get_input_embeddings().weight.detach().float().cpu().numpy()
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
    reading, inputs, tok = read(args.model, args.prompt, device_of(args))
    print(f"wrote {draw(reading, inputs, tok, args.out)}")
    return 0
