"""Catastrophic forgetting and its remedies: the pydocs-trained base model fine-tuned on pycode (the new task) in full,
with LoRA, and in full with L2-SP and with EWC (`--regularize`), the same steps each; the new task's validation loss
against the old one's (pydocs), before and after.

Prints a markdown table.   python bench/bench_forgetting.py [--steps 150]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

from lmkit.finetune.clm import finetune_causal_lm_folder  # noqa: E402

RUNS = [("full", "full", None), ("LoRA r=8", "lora", None), ("full + L2-SP 0.1", "full", "l2sp:0.1"),
        ("full + L2-SP 1", "full", "l2sp:1"), ("full + EWC 1e3", "full", "ewc:1000"),
        ("full + EWC 1e4", "full", "ewc:10000")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    folder = setup.base_model()
    rows = []
    for label, method, regularize in RUNS:
        with tempfile.TemporaryDirectory() as out:
            r = finetune_causal_lm_folder(folder, Path(out) / "run", method, ["pycode"], args.steps, 8, setup.SEQ_LEN,
                                          1e-3 if method == "full" else 3e-3, max_val_docs=60, precision="fp32",
                                          regularize=regularize, forgetting_corpus="pydocs")
        f = r["forgetting"]
        rows.append((label, r["before"]["loss"], r["after"]["loss"], f["before"]["loss"], f["after"]["loss"]))
        print(rows[-1], flush=True)
    print(machine.describe(["fp32"]))
    print(f"| fine-tuning ({args.steps} steps on pycode) | pycode val loss (task) | pydocs val loss (forgetting) |")
    print("|---|---|---|")
    for label, tb, ta, fb, fa in rows:
        print(f"| {label} | {tb:.3f} -> {ta:.3f} | {fb:.3f} -> {fa:.3f} (+{fa - fb:.3f}) |")


if __name__ == "__main__":
    main()
