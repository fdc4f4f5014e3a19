"""`lmkit generate`: continue a prompt with a saved model, streaming the text to the terminal.

Greedy unless a sampling flag (--temperature, --top-k, --top-p) is given; --num-beams runs beam
search. Models trained by `lmkit train` saw BOS at the start of every row, so their prompts get it
too; a pretrained folder's prompt gets the tokenizer's own special tokens, as transformers' tokenizer(prompt)
gives them (--bos / --no-bos override: BOS alone, or no special token). --prefix/--suffix ask a model trained
with `--objective fim` for the middle between them (the PSM prompt up to <fim_middle>); only the middle is printed.
A masked LM (an encoder folder with an MLM head) generates --max-new-tokens (default 16) tokens after the prompt
by Mask-Predict (--iterations), then optionally Gibbs resampling (--gibbs-steps).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lmkit
from lmkit.cli import utf8
from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import GenerationError


def register(subparsers) -> None:
    p = add_command(subparsers, "generate", help="continue a prompt with a saved model", description=__doc__,
                    example_lines=("lmkit generate --model runs/demo --prompt 'Return the number of'",
                                   "lmkit generate --model runs/demo --prompt 'class ' --temperature 0.8 --top-p 0.95 --seed 1",
                                   "lmkit generate --model runs/demo --prompt 'def f(' --num-beams 4 --num-return-sequences 2"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--prompt", metavar="TEXT", help="text to continue (the source text for encoder-decoder models); "
                   "required unless --prefix or --suffix is given (default: none)")
    p.add_argument("--prefix", metavar="TEXT", help="infill: the text before the gap (a fill-in-the-middle model; default: empty)")
    p.add_argument("--suffix", metavar="TEXT", help="infill: the text after the gap; prints the middle the model writes "
                   "(default: empty)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate (default: 64, or what fits in the model's context)")
    p.add_argument("--temperature", type=float, default=None, metavar="T", help="sample at this temperature (0: greedy; default: greedy)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="sample from the nucleus of mass P (default: 1, the whole distribution)")
    p.add_argument("--num-beams", type=int, default=1, metavar="B", help="beam search with B beams (default 1: no beam search)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                   help="divide the scores of tokens already present by X (default 1: none; transformers' meaning)")
    p.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="N continuations (samples, or the N best beams), printed one after another (default 1)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed for sampling, for repeatable output (default: a fresh one each run)")
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help="greedy: draft up to K tokens from earlier text and check them in one step (the same output; "
                        "default: off)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the continuation to JSON valid under the JSON schema in FILE (xgrammar; at most 4 "
                        "whitespace characters between elements; default: no constraint)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="put BOS before the prompt (default: when the folder holds an lmkit training run; other folders: the tokenizer's own special tokens)")
    g = p.add_argument_group("masked LMs (encoder folders with an MLM head)")
    g.add_argument("--iterations", type=int, default=10, metavar="N",
                   help="Mask-Predict: --max-new-tokens positions after the prompt start masked; N rounds re-mask the "
                        "least confident (default 10)")
    g.add_argument("--gibbs-steps", type=int, default=0, metavar="N",
                   help="then N Gibbs steps: one generated position at a time masked and sampled again (default 0)")
    add_device_argument(p)
    p.set_defaults(func=run)


class TerminalStreamer:
    """Prints text as tokens arrive (the `streamer=` interface of generate: put(ids), end())."""

    def __init__(self, tokenizer, prompt: str, out=None):
        self.tokenizer, self.prompt, self.out = tokenizer, prompt, sys.stdout if out is None else out
        self.ids: list[int] = []
        self.printed = 0

    def put(self, ids) -> None:
        if self.prompt is not None:  # the first put is the prompt's ids: generation passed its checks
            self.out.write(self.prompt)
            self.out.flush()
            self.prompt = None
            return
        self.ids.extend(ids.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    import torch

    from lmkit.data.tokenize import check_fits
    from lmkit.train.checkpoint import run_settings

    infill = args.prefix is not None or args.suffix is not None
    if infill == (args.prompt is not None):
        raise GenerationError("give --prompt TEXT to continue a text, or --prefix/--suffix TEXT to fill the gap "
                              "between them, not both" if infill else "give --prompt TEXT (or --prefix/--suffix TEXT to infill)")
    for flag in ("prompt", "prefix", "suffix"):
        if getattr(args, flag) is not None:
            utf8(getattr(args, flag), f"--{flag}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.top_k is not None and args.top_k < 0:
        raise GenerationError(f"--top-k must be >= 0 (0 turns it off), got {args.top_k}")
    if args.num_beams < 1:
        raise GenerationError(f"--num-beams must be >= 1 (1: no beam search), got {args.num_beams}")
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise GenerationError(f"--prompt-lookup must be >= 1, got {args.prompt_lookup}")
    if not args.repetition_penalty > 0:
        raise GenerationError(f"--repetition-penalty must be > 0 (1: none), got {args.repetition_penalty}")
    model = lmkit.load_model(args.model, device=device_of(args))
    tok = lmkit.load_tokenizer(args.model)
    # an id past the embedding table fails deep in the model, or silently never matters: refuse it up front
    check_fits(tok, model.config.vocab_size, Path(args.model) / "tokenizer.json", args.model)
    cfg = model.config
    # --temperature 0 means greedy even beside --top-k/--top-p, as its help says
    sampling = args.temperature != 0 and (any(v is not None for v in (args.top_k, args.top_p)) or bool(args.temperature))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    options = dict(max_new_tokens=64 if args.max_new_tokens is None else args.max_new_tokens, do_sample=sampling,
                   num_beams=args.num_beams, temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
                   repetition_penalty=args.repetition_penalty, num_return_sequences=args.num_return_sequences,
                   prompt_lookup_num_tokens=args.prompt_lookup)
    if args.json_schema is not None:
        options.update(grammar={"json_schema": _schema(args.json_schema)}, tokenizer=tok)
    n = args.num_return_sequences
    if infill and cfg.architecture != "decoder":
        raise GenerationError(f"{args.model} is not a decoder-only model; --prefix/--suffix infill with a decoder "
                              "trained with `lmkit train --objective fim`")
    if cfg.architecture == "encoder-decoder":
        from lmkit.evaluate.seq2seq import encode_source

        ids = torch.tensor([encode_source(tok, args.prompt, cfg.eos_token_id)])  # as training and `lmkit eval` feed it
        if args.max_new_tokens is None and cfg.position in ("learned", "sinusoidal"):
            # the decoder starts from one token; the default stops where its position table ends (BART)
            options["max_new_tokens"] = min(options["max_new_tokens"], cfg.max_seq_len - 1)
        out = model.generate(ids, **options)
        for i, row in enumerate(out.tolist()):
            print(_heading(i, n) + tok.decode(row, skip_special_tokens=True))
        return 0
    if getattr(model, "mlm_head", None) is not None:  # a masked LM fills masks instead of reading left to right
        return _fill_masks(args, model, tok, options)
    if cfg.architecture != "decoder" and getattr(model, "head", None) != "lm":  # XLNet generates either way
        raise GenerationError(f"{args.model} is an encoder model without a masked-LM head, which does not generate "
                              "text; use a decoder, an encoder-decoder or a masked-LM model")
    if infill:
        from lmkit.data.fim import infill_bos, infill_prompt

        bos = infill_bos(tok, cfg.bos_token_id) if args.bos is None else cfg.bos_token_id if args.bos else None
        ids = infill_prompt(tok, args.prefix or "", args.suffix or "", bos, where=args.model)
        args.prompt = ""  # the middle alone is printed
    elif run_settings(args.model) is None and args.bos is None:
        # a pretrained folder: the prompt as transformers' tokenizer(prompt) gives it (LLaMA's <s>, GPT-2's nothing)
        ids = tok.encode(args.prompt, add_special_tokens=True)
    else:
        ids = tok.encode(args.prompt, add_special_tokens=False)
        if args.bos is not False and cfg.bos_token_id is not None:
            ids = [cfg.bos_token_id] + ids
    if not ids:
        raise GenerationError("the prompt is empty and no BOS token starts it; give --prompt some text"
                              + (", or pass --bos" if cfg.bos_token_id is not None else ""))
    _fit_context(cfg, len(ids), args.max_new_tokens, options)
    ids_tensor = torch.tensor([ids], dtype=torch.long)
    if n > 1:  # several continuations: printed whole, one after another
        out = model.generate(ids_tensor, **options)
        for i, row in enumerate(out[:, len(ids):].tolist()):
            print(_heading(i, n) + args.prompt + tok.decode(row, skip_special_tokens=True))
        return 0
    streamer = TerminalStreamer(tok, args.prompt) if args.num_beams == 1 else None
    out = model.generate(ids_tensor, streamer=streamer, **options)
    if streamer is None:
        print(args.prompt + tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))
    return 0


def _fill_masks(args: argparse.Namespace, model, tok, options: dict) -> int:
    """Mask-Predict after the prompt ([CLS] or BOS first, [SEP] last when the tokenizer has one), then Gibbs steps."""
    import torch

    from lmkit.data.tokenize import special_ids
    from lmkit.generation.mask_predict import gibbs_resample, mask_predict
    from lmkit.train.masked import mask_token_id

    if args.num_beams != 1 or args.num_return_sequences != 1 or args.prompt_lookup is not None:
        raise GenerationError("a masked LM generates by Mask-Predict: --num-beams, --num-return-sequences and "
                              "--prompt-lookup do not apply; drop them")
    if args.iterations < 1 or args.gibbs_steps < 0:
        raise GenerationError("--iterations must be at least 1 and --gibbs-steps 0 or more")
    size = getattr(tok, "vocab_size", None)
    mask = mask_token_id(tok)
    if size is not None and mask >= model.config.vocab_size:
        raise GenerationError(f"{args.model}'s tokenizer has no mask token the model knows; use the tokenizer it was "
                              "trained with")
    cls, sep = getattr(tok, "cls_token_id", None), getattr(tok, "sep_token_id", None)
    prefix = [special_ids(tok)[0] if cls is None else cls] + tok.encode(args.prompt, add_special_tokens=False)
    suffix = [] if sep is None else [sep]
    length = options["max_new_tokens"] if args.max_new_tokens is not None else 16
    if len(prefix) + length + len(suffix) > model.config.max_seq_len:
        raise GenerationError(f"the prompt ({len(prefix)} tokens) and {length} new tokens do not fit the model's "
                              f"{model.config.max_seq_len} positions; lower --max-new-tokens")
    specials = list(getattr(tok, "all_special_ids", []) or []) + [special_ids(tok)[0]]
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    new, _ = mask_predict(model, prefix, length, mask, suffix, args.iterations, specials,
                          args.temperature or 0.0, generator)
    if args.gibbs_steps:
        row = gibbs_resample(model, prefix + new + suffix, list(range(len(prefix), len(prefix) + length)), mask,
                             args.gibbs_steps, specials, args.temperature or 1.0, generator)
        new = row[len(prefix):len(prefix) + length]
    print(args.prompt + tok.decode(new, skip_special_tokens=True))
    return 0


def _fit_context(cfg, prompt: int, asked: int | None, options: dict) -> None:
    """The default length stops where the model's context ends; an asked length past it is refused where the
    positions end (generate's own check, learned or sinusoidal tables) and said once where they go on (RoPE)."""
    if prompt >= cfg.max_seq_len:
        return  # generate's own check names the prompt's length
    room = cfg.max_seq_len - prompt
    if asked is None:
        options["max_new_tokens"] = min(options["max_new_tokens"], room)
    elif asked > room and cfg.position not in ("learned", "sinusoidal"):
        sys.stderr.write(f"lmkit generate: warning: the prompt ({prompt} tokens) and --max-new-tokens {asked} run "
                         f"{asked - room} tokens past the model's {cfg.max_seq_len} positions; it goes on, but it was "
                         f"never trained past them (--max-new-tokens {room} stays within)\n")
        sys.stderr.flush()


def _schema(path: str):
    """The JSON schema in the file `path`."""
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GenerationError(f"--json-schema {path} does not exist; give a file holding a JSON schema") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GenerationError(f"--json-schema {path} is not JSON ({exc}); give a file holding a JSON schema") from None


def _heading(i: int, n: int) -> str:
    return f"--- {i + 1} of {n}\n" if n > 1 else ""
