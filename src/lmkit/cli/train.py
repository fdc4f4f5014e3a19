"""`lmkit train`: train a model (default: the `default` preset on pydocs) into --out."""
from __future__ import annotations

import argparse
import shlex
import sys

from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.config import PRESETS
from lmkit.errors import ConfigError
from lmkit.train import Trainer, distributed
from lmkit.train.config import TrainConfig

# flag -> TrainConfig field; flags left out keep the preset's recipe (or, with --resume, the saved run's value)
FLAGS = ("preset", "objective", "corpus", "out", "max_steps", "time_budget", "batch_size", "seq_len", "lr", "lr_schedule",
         "warmup_steps", "optimizer", "precision", "log_every", "save_every", "seed", "data", "micro_batch_size",
         "keep_checkpoints", "fsdp", "sizing", "noise", "scheduled_sampling", "fim_rate", "fim_spm_rate")


def register(subparsers) -> None:
    p = add_command(subparsers, "train", help="train a language model", description=__doc__, example_lines=(
        "lmkit train                                  # the default model on pydocs, into runs/default",
        "lmkit train --preset tiny --max-steps 200 --out runs/tiny",
        "lmkit train --time-budget 600 --corpus notes/ --out runs/notes",
        "lmkit train --out runs/tiny --preset tiny --max-steps 400 --resume   # continue after Ctrl-C",
    ))
    p.add_argument("--preset", metavar="NAME", help=f"model preset ({', '.join(PRESETS)}); default: default")
    p.add_argument("--objective", choices=["clm", "mlm", "mlm-nsp", "span", "denoise", "plm", "fim"],
                   help="training objective (default: clm; mlm-nsp (BERT's masked LM + next-sentence prediction) picks "
                        "bert-tiny, span/denoise t5-tiny, plm xlnet-tiny; fim: clm with fill-in-the-middle examples)")
    p.add_argument("--noise", metavar="NAME[,NAME...]",
                   help="--objective denoise: BART's noisings, combined in fairseq's order: permutation, masking, "
                        "infilling, deletion, rotation (default: infilling,permutation, the paper's best)")
    p.add_argument("--scheduled-sampling", metavar="KIND:K",
                   help="--objective clm: feed the model its own predictions with probability 1 - eps, eps decaying "
                        "as linear:K (1 - i/K), exponential:K (K^i) or inverse_sigmoid:K (K/(K + exp(i/K))); two "
                        "passes a step (default: off, teacher forcing)")
    p.add_argument("--corpus", nargs="+", metavar="NAME|PATH",
                   help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl; NAME:WEIGHT items "
                        "(pydocs:0.7,pycode:0.3) sample the sources by weight instead of joining them; default: pydocs")
    p.add_argument("--out", metavar="DIR", help="run folder; default: runs/PRESET")
    p.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps (default 1000, or set by --time-budget)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="train for about this long; the default preset's shape is then sized for it (--sizing); "
                        "default: no budget, --max-steps")
    p.add_argument("--sizing", metavar="auto|off|LAW",
                   help="with --time-budget and the default preset: size the model from a scaling law and the speed "
                        "measured on this machine; auto (default: the pydocs law), off, chinchilla, besiroglu, pydocs "
                        "or a fit.json of `lmkit scaling fit`; naming --preset turns it off unless given")
    p.add_argument("--batch-size", type=int, metavar="N", help="sequences per optimizer step, global under torchrun (default: the preset's recipe: default 24, tiny 8, others 16)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence, the model's context (default: the preset's recipe: default 128, others the model's context, at most 1024)")
    p.add_argument("--lr", type=float, metavar="X", help="peak learning rate (default: the preset's recipe: default and tiny 3e-3, others 1e-3)")
    p.add_argument("--lr-schedule", choices=["linear", "cosine", "constant"],
                   help="after the linear warm-up: cosine or linear down to a tenth of --lr, or constant at --lr "
                        "(default: cosine)")
    p.add_argument("--warmup-steps", type=int, metavar="N",
                   help="steps of linear warm-up to the peak lr, used as given; default: the preset's (default 50, tiny "
                        "10, others 100), at most a tenth of the planned steps (--max-steps 40: 4)")
    p.add_argument("--optimizer", choices=["adamw", "muon"],
                   help="muon: Muon for the hidden weight matrices, AdamW for the rest; default: muon for the default "
                        "preset, adamw otherwise")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="compute type of training (default: bf16 where the CPU has native bf16, else fp32)")
    p.add_argument("--log-every", type=int, metavar="N", help="write metrics.jsonl every N steps (default 10)")
    p.add_argument("--save-every", type=int, metavar="N", help="checkpoint and evaluate every N steps (default: about ten times a run, on --log-every steps when the run is that long)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed (default 0)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (off by default)")
    p.add_argument("--data", metavar="DIR", help="train on token shards made by `lmkit data prepare` (instead of --corpus; default: none)")
    p.add_argument("--micro-batch-size", type=int, metavar="N",
                   help="sequences per forward/backward (global); smaller than --batch-size accumulates gradients "
                        "(default: --batch-size, no accumulation)")
    p.add_argument("--keep-checkpoints", type=int, metavar="N", help="keep the newest N checkpoints (default 3)")
    p.add_argument("--fsdp", action="store_const", const=True,
                   help="under torchrun: shard parameters and optimizer state (FSDP) instead of replicating them (DDP, the "
                        "default)")
    p.add_argument("--fim-rate", type=float, metavar="F",
                   help="--objective fim: the share of document pieces rewritten as fill-in-the-middle examples (default 0.5)")
    p.add_argument("--fim-spm-rate", type=float, metavar="F",
                   help="--objective fim: of those, the share laid out suffix-prefix-middle, the rest prefix-suffix-middle "
                        "(default 0.5)")
    add_device_argument(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, set[str]]:
    given = {f: getattr(args, f) for f in FLAGS if getattr(args, f) is not None}
    if "data" in given and "corpus" in given:  # --data wins in the trainer, so --corpus would be silently ignored
        raise ConfigError("--data and --corpus both name the training text; give one (--data DIR for prepared shards)")
    fim_flags = [f"--{f.replace('_', '-')}" for f in ("fim_rate", "fim_spm_rate") if f in given]
    if fim_flags and given.get("objective") != "fim":
        raise ConfigError(f"{' and '.join(fim_flags)}: only --objective fim reads it; add --objective fim")
    if "preset" not in given and given.get("objective") in ("span", "denoise"):
        given["preset"] = "t5-tiny"  # encoder-decoder objectives need an encoder-decoder model
    if "preset" not in given and given.get("objective") == "mlm-nsp":
        given["preset"] = "bert-tiny"  # BERT's pre-training head
    if "preset" not in given and given.get("objective") == "plm":
        given["preset"] = "xlnet-tiny"  # permutation LM needs XLNet's two streams
    if "preset" in given:  # a named preset is trained as it is
        given.setdefault("sizing", "off")
    given.setdefault("out", f"runs/{given.get('preset', 'default')}")
    return TrainConfig(resume=args.resume, **given), set(given) - {"out"}


def run(args: argparse.Namespace) -> int:
    ctx = distributed.setup(device_of(args))  # torchrun: one process per rank (cuda: each its own GPU); else one
    started: dict = {}  # the run's folder and trainer once set up, for the message of a Ctrl-C

    def body():
        with distributed.agree_on_setup(ctx):  # every rank learns whether set-up succeeded on all of them
            cfg, explicit = config_from_args(args)
            started["out"] = cfg.out
            trainer = Trainer(cfg, explicit=explicit, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
            started["trainer"] = trainer
        c = trainer.cfg
        if ctx.is_main and trainer.sizing is not None:
            print(f"lmkit train: {trainer.sizing.describe()}")
        if ctx.is_main:
            print(f"lmkit train: preset {c.preset}, {trainer.model.num_parameters() / 1e6:.2f}M parameters, "
                  f"vocab {trainer.model_config.vocab_size}, " + (f"data {c.data}" if c.data else f"corpus {' '.join(c.corpus)}")
                  + f" ({trainer.stream.num_tokens} training tokens), batch {c.batch_size} x {c.seq_len}, {c.precision}"
                  + (f" on {ctx.device}" if ctx.device.type != "cpu" else "")
                  + (f", {ctx.world_size} processes ({'FSDP' if c.fsdp else 'DDP'}, {ctx.backend})" if ctx.world_size > 1 else "")
                  + (f", resuming at step {trainer.step}" if c.resume else ""))
        result = trainer.fit()  # an error while training may be one rank's own: every rank reports its own
        if ctx.is_main:
            print(summary(result, c.out))

    try:
        return distributed.run_ranks(ctx, body)[1]
    except KeyboardInterrupt:
        if ctx.is_main:
            print(interrupted(started.get("out"), getattr(started.get("trainer"), "step", None)), file=sys.stderr)
        return 130


def interrupted(out: str | None, step: int | None) -> str:
    """What a Ctrl-C of `lmkit train` leaves: the last save in `out` and the command that resumes from it."""
    from lmkit.errors import LmkitError
    from lmkit.train.checkpoint import STEP_DIR, latest_checkpoint

    at = f" at step {step}" if step else ""
    if out is None:
        return "lmkit: interrupted before training began; nothing was saved"
    try:
        last = latest_checkpoint(out, warn=lambda message: None)
    except LmkitError:  # every checkpoint damaged: its own error says so on --resume
        last = None
    if last is None:
        return f"lmkit: interrupted{at}, before the first save; nothing to resume: run the command again"
    saved = int(STEP_DIR.fullmatch(last.name).group(1))
    return (f"lmkit: interrupted{at}; the last save is step {saved} in {out}: `lmkit train --out {shlex.quote(out)} --resume` "
            "continues from it")


def summary(result: dict, out: str) -> str:
    line = f"step {result['step']}: {result['train_tokens']} tokens in {result['elapsed']:.0f}s"
    if "val_masked_loss" in result:  # a masked LM: its loss covers the masked tokens only, no perplexity of the text
        line += (f"; validation masked loss {result['val_masked_loss']:.4f} nats/token, masked-token accuracy "
                 f"{result['val_masked_accuracy']:.4f}")
        if "val_nsp_accuracy" in result:
            line += f", NSP loss {result['val_nsp_loss']:.4f}, NSP accuracy {result['val_nsp_accuracy']:.4f}"
    elif "val_loss" in result:
        line += (f"; validation loss {result['val_loss']:.4f} nats/token, perplexity {result['val_perplexity']:.2f}, "
                 f"{result['val_bpb']:.4f} bits per byte")
    if "mixture" in result:
        line += "; tokens by source " + ", ".join(f"{k} {v:.1%}" for k, v in result["mixture"].items())
    return line + f"; saved to {out}"
