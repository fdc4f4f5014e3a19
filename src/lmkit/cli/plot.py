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
from lmkit.cli.common import add_device_argument, device_of
from lmkit.cli.lens import add_arguments, draw, read
from lmkit.data import load_corpus
from lmkit.errors import ConfigError
from lmkit.plots import model_name, quoted


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
    add_device_argument(att)
    att.set_defaults(func=run_attention)
    emb = add_command(sub, "embeddings", help="2-D PCA of token embeddings or word vectors",
                      description="The first two principal components of a model's input token embeddings, or of "
                                  "word vectors, each point labelled.", example_lines=(
                          "lmkit plot embeddings --model runs/demo",
                          "lmkit plot embeddings --vectors vectors/ --words list dict tuple set int str"))
    src = emb.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a model folder: its input token embeddings")
    src.add_argument("--vectors", metavar="DIR", help="word vectors from `lmkit embed train`, or a word2vec text file")
    emb.add_argument("--words", nargs="+", metavar="WORD",
                     help="the words or tokens to show (default: the --k most frequent whole words; see --corpus)")
    emb.add_argument("--k", type=int, default=100, dest="count", metavar="K",
                     help="how many to show without --words (default 100)")
    hidden_alias(emb, "--count", dest="count", type=int)
    emb.add_argument("--corpus", nargs="+", metavar="NAME|PATH",
                     help="with --model, rank words by their count in this corpus (default: the corpus the run was "
                          "trained on, from its checkpoint or its parent run's; else the tokenizer's first word pieces)")
    emb.add_argument("--out", default="embeddings.png", metavar="PNG", help="the picture")
    add_device_argument(emb)
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
    model = lmkit.load_model(args.model, device=device_of(args))
    tok = lmkit.load_tokenizer(args.model)
    ids = tok.encode(args.text)
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
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
    title = f"attention of {model_name(args.model)} on {quoted(args.text)}"
    png = plot_attention_grid(arrays, labels, args.out, title=title)
    page = attention_html(arrays, labels, args.html or Path(args.out).with_suffix(".html"), title=title)
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


SAMPLE_CHARS = 1_000_000  # words are counted in the corpus' first million characters: enough to rank 100


def trained_corpus(folder: str) -> list[str] | None:
    """The corpus names a training run in `folder` (or in its parent: a tuned stage such as runs/demo/sft) was
    trained on, read from its newest checkpoint's state.json; None when neither says."""
    import json
    from pathlib import Path

    for run in (Path(folder), Path(folder).resolve().parent):
        states = sorted((run / "checkpoint").glob("step-*/state.json"))
        if states:
            try:
                corpus = json.loads(states[-1].read_text(encoding="utf-8")).get("train_config", {}).get("corpus")
            except (OSError, ValueError):
                continue
            if corpus:
                return [corpus] if isinstance(corpus, str) else list(corpus)
    return None


def _sample(corpus: list[str]) -> list[str]:
    texts, size = [], 0
    for doc in load_corpus(corpus).documents:
        texts.append(doc.text)
        size += len(doc.text)
        if size >= SAMPLE_CHARS:
            break
    return texts


def run_embeddings(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmkit.plots.embeddings import first_words, frequent_words, plot_embeddings

    if args.count < 2:
        raise ConfigError(f"--count must be at least 2 (a PCA needs two vectors), got {args.count}")
    if args.vectors:
        from lmkit.embed import WordVectors

        if args.corpus:
            raise ConfigError("--corpus ranks a model's tokens; word vectors are already in frequency order")
        vectors = WordVectors.load(args.vectors)
        labels = args.words or vectors.words[:args.count]
        missing = [w for w in labels if w not in vectors]
        if missing:
            raise ConfigError(f"not in the vocabulary: {' '.join(missing)}")
        matrix = vectors.vectors[[vectors.index[w] for w in labels]]
        title = f"word vectors of {model_name(args.vectors)}: PCA of {len(labels)} words"
    else:
        model = lmkit.load_model(args.model, device=device_of(args))
        tok = lmkit.load_tokenizer(args.model)
        E = model.get_input_embeddings().weight.detach().float().cpu().numpy()
        name = model_name(args.model)
        if args.words:
            ids = [tok.encode(w, add_special_tokens=False) for w in args.words]
            bad = [w for w, i in zip(args.words, ids) if len(i) != 1]
            if bad:
                raise ConfigError(f"not single tokens of this tokenizer: {' '.join(bad)}; give words it keeps whole")
            ids = [i[0] for i in ids]
            title = f"token embeddings of {name}: PCA of {len(ids)} chosen tokens"
        else:
            corpus = args.corpus or trained_corpus(args.model)
            ids = frequent_words(tok, _sample(corpus), args.count) if corpus else []
            if len(ids) >= 2:
                title = (f"token embeddings of {name}: PCA of the {len(ids)} most frequent words of "
                         f"{', '.join(Path(c).name for c in corpus)}")
            else:
                ids = first_words(tok, args.count)
                title = f"token embeddings of {name}: PCA of its first {len(ids)} word tokens (lowest ids)"
        ids = [i for i in ids if i < E.shape[0]]
        labels = [tok.decode([i]) for i in ids]
        if not args.words:  # word-start pieces all begin with the space that marks a word: say it once, in the title
            labels = [label.strip() for label in labels]
        matrix = E[ids]
    if len(labels) < 2:
        raise ConfigError("a PCA needs at least two vectors; give more --words or a larger --count")
    print(f"wrote {plot_embeddings(labels, matrix, args.out, title)}")
    return 0


def run_lens(args: argparse.Namespace) -> int:
    reading, inputs, tok = read(args.model, args.prompt, device_of(args))
    print(f"wrote {draw(reading, inputs, tok, args.out, args.model, args.prompt, args.embeddings_row)}")
    return 0
