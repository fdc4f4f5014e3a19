"""`lmkit eval`: loss, perplexity and bits per byte of a model on a corpus; a masked LM (mlm, mlm-nsp runs):
its masked-token loss and accuracy (and NSP loss and accuracy), which are no perplexity of the text.

The corpus the model was trained on, and a built-in corpus, are scored on their validation split
(the numbers training reports); any other text is held out already and is scored whole.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lmkit
from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.data import load_corpus
from lmkit.data.builtin import BUILTIN
from lmkit.data.corpus import same_files
from lmkit.errors import ConfigError, CorpusError


def register(subparsers) -> None:
    p = add_command(subparsers, "eval", help="evaluate a language model (loss, perplexity, bits per byte; masked LMs: masked loss and accuracy)",
                    description=__doc__, example_lines=(
                        "lmkit eval --model runs/demo                   # its training corpus's validation split",
                        "lmkit eval --model runs/demo --corpus notes/ --stride 64",
                        "lmkit eval --model runs/t5 --task numbers --num-beams 4"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--corpus", nargs="+", metavar="NAME|PATH",
                   help="text to score: its validation split if the model was trained on it or it is built in, "
                        "else all of it; default: the corpus the model was trained on, else pydocs")
    p.add_argument("--pairs", metavar="PATH", help="text-to-text models: BLEU/ROUGE on (source, reference) pairs, .tsv or .jsonl (default: none)")
    p.add_argument("--task", choices=["numbers"], help="text-to-text models: the held-out set of a built-in task (default: none)")
    p.add_argument("--num-beams", type=int, default=1, metavar="B", help="beam search width for --pairs/--task (default 1: greedy)")
    p.add_argument("--stride", type=int, metavar="N", help="causal LMs: read each document in windows of the model's "
                   "context that start N tokens apart, so every token is scored after at least context - N tokens "
                   "(transformers' perplexity recipe); default: pieces of the context, each read after BOS")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmkit.data.tokenize import check_fits
    from lmkit.evaluate import evaluate_text
    from lmkit.train.checkpoint import run_settings

    if args.num_beams < 1:  # before loading anything: nothing printed for a run that cannot happen
        raise ConfigError(f"--num-beams must be at least 1, got {args.num_beams}")
    if args.stride is not None and args.stride < 1:
        raise ConfigError(f"--stride must be at least 1, got {args.stride}")
    settings = run_settings(args.model) or {}
    corpus = args.corpus or settings.get("corpus") or ["pydocs"]
    trained_on = settings.get("corpus")
    if args.corpus and trained_on and args.corpus != trained_on and same_files(args.corpus, trained_on):
        # the training files spelled otherwise: document ids (and so the split) follow the spelling training used
        corpus = args.corpus = trained_on
    model = lmkit.load_model(args.model, device=device_of(args))
    arch = model.config.architecture
    if (args.pairs or args.task) and arch != "encoder-decoder":
        raise ConfigError(f"--pairs and --task score text-to-text (encoder-decoder) models, and {args.model} holds "
                          f"a{'n' if arch == 'encoder' else ''} {arch} model; score it on text with --corpus instead")
    if arch == "encoder" and getattr(model, "mlm_head", None) is None:
        raise ConfigError(f"{args.model} holds an encoder without a masked-LM head; lmkit eval scores language "
                          "models (causal, masked-LM or encoder-decoder)")
    tokenizer = lmkit.load_tokenizer(args.model)
    check_fits(tokenizer, model.config.vocab_size, Path(args.model) / "tokenizer.json", args.model)
    # models scored under their objective's fixed corruption: span / denoise runs, and masked-LM encoders
    corrupting = settings.get("objective") if settings.get("objective") in ("span", "denoise") else None
    if arch == "encoder":  # BERT's pre-training head is scored on pairs (mlm-nsp), any other MLM head on masking
        corrupting = "mlm-nsp" if getattr(model, "head", None) == "pretraining" else "mlm"
    if args.stride is not None and (corrupting or args.pairs or args.task or arch != "decoder"):
        raise ConfigError("--stride applies to causal language models (next-token loss over overlapping windows); "
                          f"{args.model} is scored otherwise, so drop --stride")
    if args.pairs or args.task or (arch == "encoder-decoder" and not corrupting):
        from lmkit.evaluate.seq2seq import report_pairs, resolve_pairs

        if args.corpus:  # would be ignored: the scores come from pairs, not from text
            raise ConfigError(f"--corpus scores text, but {args.model} is scored here on (source, reference) pairs; "
                              "drop --corpus (a span/denoise run is scored on text without --pairs/--task)")
        name, pairs = resolve_pairs(args.model, args.pairs, args.task)
        print(f"{args.model} on {name} ({len(pairs)} pairs)")
        print("\n".join(report_pairs(model, tokenizer, pairs, args.num_beams)))
        return 0

    held_out = args.corpus and args.corpus != settings.get("corpus") and not all(s in BUILTIN for s in args.corpus)
    try:
        text = load_corpus(corpus)
    except CorpusError as exc:
        if args.corpus:
            raise
        raise CorpusError(f"the corpus {args.model} was trained on cannot be read from here ({exc}); "
                          "pass --corpus, or run from the folder the training ran in") from None
    if held_out:  # text the model never trained on: every document counts (a single file is enough)
        val, part = text, "all"
    else:
        val, part = text.split(settings.get("val_fraction", 0.05))[1], "validation split:"
    if corrupting:  # the loss of the corrupted tokens (mlm: masked; span / denoise: targets), as training reports it
        from lmkit.train.objectives import evaluate_corpus

        r = evaluate_corpus(model, tokenizer, val, corrupting, settings.get("seq_len"), noise=settings.get("noise"))
    else:
        r = evaluate_text(model, tokenizer, val, stride=args.stride)
    print(f"{args.model} on {' '.join(corpus)} ({part} {len(val)} documents, {r['bytes']} bytes, {r['tokens']} tokens)")
    if "masked_loss" in r:  # a masked LM's loss covers ~15% of the tokens, each read from both sides: no perplexity
        print(f"masked loss    {r['masked_loss']:.4f} nats/masked token")
        print(f"masked acc     {r['masked_accuracy']:.4f}")
        if "nsp_loss" in r:
            print(f"nsp loss       {r['nsp_loss']:.4f} nats/pair")
            print(f"nsp acc        {r['nsp_accuracy']:.4f}")
        return 0
    print(f"loss           {r['loss']:.4f} nats/token")
    print(f"perplexity     {r['perplexity']:.3f}")
    print(f"bits per byte  {r['bpb']:.4f}")
    return 0
