"""`lmkit distill`: a student with every other layer of a teacher, trained on the teacher's soft targets
(DistilBERT's loss: alpha CE + beta T^2 KL + gamma cosine of hidden states)."""
from __future__ import annotations

import argparse

from lmkit.cli.common import add_device_argument, device_of


def register(subparsers) -> None:
    p = subparsers.add_parser("distill", help="distil a causal LM into one with half the layers", description=__doc__)
    p.add_argument("--teacher", required=True, metavar="DIR", help="teacher folder (from `lmkit train`)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the student is written")
    p.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH", help="training text (default pydocs)")
    p.add_argument("--max-steps", type=int, default=200, metavar="N")
    p.add_argument("--batch-size", type=int, default=16, metavar="N")
    p.add_argument("--seq-len", type=int, metavar="N", help="default: the teacher's context, at most 256")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=2, help="keep layers 0, every, 2*every, ... (default 2)")
    p.add_argument("--alpha", type=float, default=2.0, help="weight of the cross-entropy with the labels")
    p.add_argument("--beta", type=float, default=5.0, help="weight of T^2 KL(teacher || student)")
    p.add_argument("--gamma", type=float, default=1.0, help="weight of 1 - cos(hidden states)")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmkit.compress.distill import DistillWeights
    from lmkit.compress.recipes import distill_folder

    def log(row):
        if row["step"] % 20 == 0 or row["step"] == args.max_steps:
            print(f"step {row['step']:5d}  loss {row['loss']:.4f}  ce {row['ce']:.4f}  kl {row['kl']:.4f}  cos {row['cos']:.4f}")

    w = DistillWeights(args.alpha, args.beta, args.gamma, args.temperature)
    r = distill_folder(args.teacher, args.out, args.corpus, args.max_steps, args.batch_size, args.seq_len, args.lr,
                       args.every, w, args.seed, log=log, device=device_of(args))
    for who in ("teacher", "student"):
        m = r[who]
        print(f"{who:8s} {m['layers']} layers, {m['parameters']:,} parameters: loss {m['loss']:.4f}, "
              f"perplexity {m['perplexity']:.2f}, next-token accuracy {m['accuracy']:.4f}")
    teacher, student = r["teacher"]["accuracy"], r["student"]["accuracy"]
    kept = (f"student keeps {100 * student / teacher:.1f}% of the teacher's accuracy" if teacher > 0 else
            "the teacher predicts no next token right, so there is no share of its accuracy to keep")
    print(f"{kept}; written to {args.out}")
    return 0
