"""`lmkit prune`: remove the least important attention heads (Michel et al. 2019) structurally: of a causal LM by
its next-token loss on --corpus, or of a fine-tuned encoder classifier (`lmkit finetune`) by its classification loss
on --data's labelled rows, with accuracy on them before and after; or zero the smallest weights of a causal LM
(`--unstructured`, magnitude pruning, at once or gradually as Zhu and Gupta 2017)."""
from __future__ import annotations

import argparse

from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of


def register(subparsers) -> None:
    p = add_command(subparsers, "prune", help="prune attention heads (a causal LM or an encoder classifier) or single "
                    "weights (a causal LM)", description=__doc__,
                    example_lines=("lmkit prune --model runs/demo --out runs/demo-pruned --heads 4",
                                   "lmkit prune --model runs/demo --out runs/demo-sparse --unstructured 0.5",
                                   "lmkit prune --model runs/demo --out runs/demo-sparse --unstructured 0.8 "
                                   "--gradual-steps 200"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (from `lmkit train`)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the pruned model is written")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--heads", type=int, metavar="N", help="number of heads to remove")
    what.add_argument("--unstructured", type=float, metavar="X",
                      help="fraction of the blocks' linear weights to zero by magnitude, in [0, 1)")
    p.add_argument("--scope", choices=["global", "layer"], default="global",
                   help="--unstructured: rank the weights of all layers together, or prune each matrix to the same "
                        "fraction (default global)")
    p.add_argument("--gradual-steps", type=int, default=0, metavar="N",
                   help="--unstructured: fine-tune N steps on --corpus while the sparsity rises along the cubic "
                        "schedule (default 0: prune at once)")
    p.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="text for the importance scores and the evaluation (default pydocs)")
    p.add_argument("--batches", type=int, default=8, metavar="N", help="batches that estimate head importance (default 8)")
    p.add_argument("--data", metavar="FILE", help="an encoder classifier: CSV or JSONL rows with text and label for "
                   "the importance scores and the accuracy (default: none; required for encoders)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from lmkit.compress.recipes import prune_folder, sparsify_folder

    stage = lambda text: print(f"lmkit prune: {text}", file=sys.stderr, flush=True)  # noqa: E731
    if args.unstructured is not None:
        r = sparsify_folder(args.model, args.out, args.unstructured, args.scope, args.gradual_steps, args.corpus,
                            device=device_of(args), stage=stage)
        print(f"sparsity {r['sparsity']:.1%} of {r['prunable_parameters']:,} prunable weights ({r['scope']})")
        for when in ("before", "after"):
            m = r[when]
            print(f"{when:6s} loss {m['loss']:.4f}  perplexity {m['perplexity']:.2f}  accuracy {m['accuracy']:.4f}")
        t = r["matmul_seconds"]
        print(f"widest layer x W^T: dense {t['dense'] * 1e3:.3f} ms, sparse CSR {t['sparse_csr'] * 1e3:.3f} ms")
        print(f"written to {args.out}")
        return 0
    r = prune_folder(args.model, args.out, args.heads, args.corpus, args.batches, progress=True, device=device_of(args),
                     stage=stage, data_file=args.data)
    print(f"pruned {r['heads_pruned']} heads: {r['parameters_before']:,} -> {r['parameters_after']:,} parameters")
    for layer, heads in r["pruned"].items():
        print(f"  {layer}: {heads}")
    for when in ("before", "after"):
        m = r[when]
        if "loss" not in m:  # a classifier: its accuracy on --data
            print(f"{when:6s} accuracy {m['accuracy']:.4f}")
            continue
        print(f"{when:6s} loss {m['loss']:.4f}  perplexity {m['perplexity']:.2f}  accuracy {m['accuracy']:.4f}")
    print(f"written to {args.out}")
    return 0
