"""`lmkit distill`: a student with every other layer of a teacher, trained on the teacher's soft targets
(DistilBERT's loss: alpha CE + beta T^2 KL + gamma cosine of hidden states). The teacher is a causal LM (next-token
rows) or an encoder with a masked-LM head (BERT, RoBERTa, DistilBERT, an mlm run: BERT's masking of the rows, every
term over the masked positions, scored by masked loss and masked-token accuracy)."""
from __future__ import annotations

import argparse

from lmkit.cli.helptext import add_command
from lmkit.cli.common import device_of
from lmkit.cli.finetune import add_run_arguments


def register(subparsers) -> None:
    p = add_command(subparsers, "distill", help="distil a causal LM or a masked-LM encoder into one with half the layers", description=__doc__,
                    example_lines=("lmkit distill --teacher runs/demo --out runs/demo-small",
                                   "lmkit distill --teacher runs/demo --out runs/demo-small --max-steps 500 --temperature 4"))
    p.add_argument("--teacher", required=True, metavar="DIR", help="teacher folder: a causal LM, or an encoder with a masked-LM head (`lmkit train --objective mlm`, "
                   "BertForMaskedLM)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the student is written")
    p.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH", help="training text (default pydocs)")
    p.add_argument("--max-steps", type=int, default=200, metavar="N", help="optimizer steps of the student")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="sequences per step")
    p.add_argument("--seq-len", type=int, metavar="N", help="default: the teacher's context, at most 256")
    p.add_argument("--lr", type=float, default=1e-3, metavar="X", help="peak learning rate (warm-up, then cosine decay)")
    p.add_argument("--every", type=int, default=2, metavar="N", help="keep layers 0, N, 2N, ... of the teacher")
    p.add_argument("--alpha", type=float, default=2.0, metavar="X", help="weight of the cross-entropy with the labels")
    p.add_argument("--beta", type=float, default=5.0, metavar="X", help="weight of T^2 KL(teacher || student)")
    p.add_argument("--gamma", type=float, default=1.0, metavar="X", help="weight of 1 - cos(hidden states)")
    p.add_argument("--temperature", type=float, default=2.0, metavar="T", help="softmax temperature of the soft targets")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed")
    add_run_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from lmkit.compress.distill import DistillWeights
    from lmkit.cli.finetune import on_every_rank, run_settings
    from lmkit.compress.recipes import distill_folder
    from lmkit.progress import progress_bar

    bar = progress_bar(total=args.max_steps, desc="distill", unit="step", dynamic_ncols=True)  # stderr, terminal only

    def log(row):
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
        if row["step"] % 20 == 0 or row["step"] == args.max_steps:  # above the bar, which stays at the bottom
            bar.write(f"step {row['step']:5d}  loss {row['loss']:.4f}  ce {row['ce']:.4f}  kl {row['kl']:.4f}  "
                      f"cos {row['cos']:.4f}")
        if row["step"] == args.max_steps:
            bar.close()
            print("lmkit distill: scoring teacher and student on the validation split", file=sys.stderr, flush=True)

    w = DistillWeights(args.alpha, args.beta, args.gamma, args.temperature)
    try:
        r, status = on_every_rank(lambda: distill_folder(args.teacher, args.out, args.corpus, args.max_steps,
                                                         args.batch_size, args.seq_len, args.lr, args.every, w,
                                                         args.seed, log=log, **run_settings(args)), device_of(args))
    finally:
        bar.close()
    if r is None:
        return status
    key = "masked_accuracy" if "masked_accuracy" in r["teacher"] else "accuracy"
    for who in ("teacher", "student"):
        m = r[who]
        scores = (f"masked loss {m['masked_loss']:.4f}, masked-token accuracy {m['masked_accuracy']:.4f}"
                  if key == "masked_accuracy" else
                  f"loss {m['loss']:.4f}, perplexity {m['perplexity']:.2f}, next-token accuracy {m['accuracy']:.4f}")
        print(f"{who:8s} {m['layers']} layers, {m['parameters']:,} parameters: {scores}")
    teacher, student = r["teacher"][key], r["student"][key]
    kept = (f"student keeps {100 * student / teacher:.1f}% of the teacher's accuracy" if teacher > 0 else
            "the teacher predicts no next token right, so there is no share of its accuracy to keep")
    print(f"{kept}; written to {args.out}")
    return 0
