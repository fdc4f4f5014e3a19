"""Unstructured magnitude pruning curve (Zhu and Gupta 2017): the blocks' linear weights of smallest |w| zeroed,
globally or per layer, at once or gradually while fine-tuning; validation score after each cut, beside the time of
the widest layer's product as dense and as torch.sparse CSR ("harder to accelerate").

Prints markdown tables and writes docs/img/sparsity_curve.png.   python bench/bench_sparsity.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

import lmkit  # noqa: E402
from lmkit.compress.sparsity import (GradualPruning, apply_masks, magnitude_masks, prunable,  # noqa: E402
                                     sparse_speed, sparsity_report)
from lmkit.finetune.clm import train_causal_lm  # noqa: E402

LEVELS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
GRADUAL = (0.5, 0.8)
GRADUAL_STEPS = 120


def main() -> None:
    folder = setup.base_model()
    data = setup.data(folder, "pydocs")
    rows = []
    for s in LEVELS:
        row = {"sparsity": s}
        for scope in ("global", "layer"):
            model = lmkit.load_model(folder)
            apply_masks(model, magnitude_masks(model, s, scope))
            r = data.evaluate(model)
            row[f"{scope}_loss"], row[f"{scope}_acc"] = r["loss"], r["accuracy"]
        widest = max(prunable(model).values(), key=lambda w: w.numel()).detach()
        t = sparse_speed(widest, batch=128, repeats=30)
        row["dense_ms"], row["csr_ms"] = t["dense"] * 1e3, t["sparse_csr"] * 1e3
        rows.append(row)
        print(row, flush=True)
    tuned = {}
    for s in (0.0, *GRADUAL):  # the same fine-tuning with no pruning is the fair reference
        model = lmkit.load_model(folder)
        end = (3 * (GRADUAL_STEPS - 1)) // 4
        train_causal_lm(model, data.stream, data.pad, GRADUAL_STEPS, 8, 1e-4, warmup_steps=0,
                        pruning=GradualPruning(s, 0, end, max(1, end // 8)) if s else None)
        r = data.evaluate(model)
        tuned[s] = (sparsity_report(model)["sparsity"], r["loss"], r["accuracy"])
        print(s, tuned[s], flush=True)
    print(machine.describe(["fp32"]))
    print("| sparsity | val loss, global | acc., global | val loss, per layer | acc., per layer | widest layer dense (ms) "
          "| as CSR (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sparsity']:.0%} | {r['global_loss']:.3f} | {r['global_acc']:.3f} | {r['layer_loss']:.3f} | "
              f"{r['layer_acc']:.3f} | {r['dense_ms']:.3f} | {r['csr_ms']:.3f} |")
    print(f"\n| gradual ({GRADUAL_STEPS} fine-tuning steps) | reached sparsity | val loss | acc. |\n|---|---|---|---|")
    for s, (got, loss, acc) in tuned.items():
        print(f"| {'no pruning' if not s else f'{s:.0%}'} | {got:.1%} | {loss:.3f} | {acc:.3f} |")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    x = [r["sparsity"] for r in rows]
    ax.plot(x, [r["global_loss"] for r in rows], "o-", label="one-shot, global")
    ax.plot(x, [r["layer_loss"] for r in rows], "s--", label="one-shot, per layer")
    ax.plot(list(GRADUAL), [tuned[s][1] for s in GRADUAL], "^", markersize=9,
            label=f"gradual, {GRADUAL_STEPS} fine-tuning steps")
    ax.axhline(tuned[0.0][1], color="0.5", linewidth=1, label="fine-tuned alone, 0% pruned")
    ax.set_xlabel("fraction of the blocks' linear weights zeroed")
    ax.set_ylabel("validation loss (nats/token, pydocs)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(__file__).resolve().parent.parent / "docs" / "img" / "sparsity_curve.png")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
