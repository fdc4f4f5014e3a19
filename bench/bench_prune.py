"""Head pruning curve (Michel et al. 2019): heads ranked once by |dL/dxi_h| on training batches of
pydocs, the least important removed structurally, no retraining; validation score after each cut.

Prints a markdown table and writes docs/img/prune_curve.png.   python bench/bench_prune.py
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

import torch  # noqa: E402

import lmkit  # noqa: E402
from lmkit.compress import head_importance, prune_heads  # noqa: E402
from lmkit.compress.prune import attention_modules  # noqa: E402
from lmkit.compress.recipes import tokens_per_second  # noqa: E402


def forward_flops_per_token(model, context: int) -> float:
    """Multiply-adds x 2 of one token's forward pass at a given context length: 2 per weight of every
    linear layer, plus 4 * context * head_dim per attention head (scores q k^T and the sum over v)."""
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads = sum(a.n_heads * a.head_dim for a in attention_modules(model).values())
    return 2.0 * linear + 4.0 * context * heads


def pick(order, n: int, importance) -> dict[str, list[int]]:
    """The first n heads of `order` (score, module, head), leaving at least one head in every layer."""
    chosen: dict[str, list[int]] = {}
    for _, name, h in order:
        if sum(map(len, chosen.values())) >= n:
            break
        if len(chosen.get(name, [])) < len(importance[name]) - 1:
            chosen.setdefault(name, []).append(h)
    return chosen


def main() -> None:
    folder = setup.base_model()
    data = setup.data(folder, "pydocs")
    model = lmkit.load_model(folder)
    batches = [data.stream.rows(1234, i, 8) for i in range(8)]
    t = time.perf_counter()
    importance = head_importance(model, batches)
    seconds = time.perf_counter() - t
    order = sorted(((float(s[h]), name, h) for name, s in importance.items() for h in range(len(s))))
    shuffled = list(order)
    random.Random(0).shuffle(shuffled)
    total = sum(len(s) for s in importance.values())
    rows, probe = [], data.val_rows[:8, :-1]
    for n in (0, 4, 8, 12, 16, 20, 24, 28):
        model = lmkit.load_model(folder)
        chosen = pick(order, n, importance)  # the n least important, at least one head kept per layer
        if chosen:
            prune_heads(model, chosen)
        r = data.evaluate(model)
        baseline = lmkit.load_model(folder)  # the same number of heads, chosen at random
        if n:
            prune_heads(baseline, pick(shuffled, n, importance))
        rand = data.evaluate(baseline)
        heads = sum(m.n_heads for m in attention_modules(model).values())
        rows.append({"pruned": sum(map(len, chosen.values())), "heads": f"{heads}/{total}",
                     "params": f"{model.num_parameters():,}", "loss": r["loss"], "acc": r["accuracy"],
                     "mflops": f"{forward_flops_per_token(model, setup.SEQ_LEN) / 1e6:.2f}",
                     "speed": f"{tokens_per_second(model, probe, repeats=5):.0f}",
                     "rand_loss": f"{rand['loss']:.3f}", "rand_acc": rand["accuracy"]})
        print(rows[-1], flush=True)
    for r in rows:
        r["loss_s"], r["acc_s"], r["rand_acc_s"] = f"{r['loss']:.3f}", f"{r['acc']:.3f}", f"{r['rand_acc']:.3f}"
    print(f"\nimportance from 8 batches x 8 x {setup.SEQ_LEN} tokens ({seconds:.1f} s); validation of pydocs\n")
    print(machine.describe(["fp32"]))
    print(setup.table(rows, [("pruned", "heads pruned"), ("heads", "heads left"), ("params", "parameters"),
                             ("loss_s", "val loss"), ("acc_s", "next-token acc."),
                             ("rand_loss", "val loss, random heads"), ("rand_acc_s", "acc., random heads"), ("mflops", "MFLOPs/token (T=128)"),
                             ("speed", "forward tokens/s (noisy)")]))
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([r["pruned"] for r in rows], [r["acc"] for r in rows], "o-", label="least important first")
    ax.plot([r["pruned"] for r in rows], [r["rand_acc"] for r in rows], "s--", label="random heads")
    ax.legend()
    ax.set_xlabel(f"heads pruned (of {total})")
    ax.set_ylabel("next-token accuracy (pydocs validation)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(__file__).resolve().parent.parent / "docs" / "img" / "prune_curve.png")


if __name__ == "__main__":
    import argparse

    # no options; --help describes the run instead of starting it
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
