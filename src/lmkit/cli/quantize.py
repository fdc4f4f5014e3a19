"""`lmkit quantize`: dynamic int8 quantization of the linear layers for CPU inference, and what it changes
(weight size, forward speed, validation loss)."""
from __future__ import annotations

import argparse

from lmkit.cli.helptext import add_command


def register(subparsers) -> None:
    p = add_command(subparsers, "quantize", help="measure dynamic int8 quantization of a causal LM", description=__doc__,
                    example_lines=("lmkit quantize --model runs/demo", "lmkit quantize --model runs/demo --out runs/demo-int8"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (from `lmkit train`)")
    p.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH", help="evaluation text (default pydocs)")
    p.add_argument("--out", metavar="DIR", help="also write the int8 model here, which lmkit.load_model loads (default: report only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmkit.compress.recipes import quantize_report

    r = quantize_report(args.model, args.corpus, out_dir=args.out)
    f, q = r["fp32"], r["int8"]
    print("| | weights (MB) | tokens/s | val loss | accuracy |")
    print("|---|---|---|---|---|")
    for name, m in r.items():
        print(f"| {name} | {m['bytes'] / 1e6:.2f} | {m['tokens_per_s']:.0f} | {m['loss']:.4f} | {m['accuracy']:.4f} |")
    print(f"size x{q['bytes'] / f['bytes']:.2f}, speed x{q['tokens_per_s'] / f['tokens_per_s']:.2f}, "
          f"loss {q['loss'] - f['loss']:+.4f} nats/token")
    if args.out:
        print(f"int8 model written to {args.out}")
    return 0
