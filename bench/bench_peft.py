"""PEFT methods side by side on one task: adapt the base model (trained on Python's docs, `pydocs`)
to Python source code (`pycode`) with the same steps, batch and data for every method.

Prints a markdown table: validation loss / perplexity / next-token accuracy on pycode, trainable
parameters (count and share), and wall time.   python bench/bench_peft.py [--steps N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

import lmkit  # noqa: E402
from lmkit.peft import get_peft_model, trainable_summary  # noqa: E402
from lmkit.finetune.clm import train_causal_lm  # noqa: E402

METHODS = {  # method -> (settings, learning rate)
    "full fine-tuning": ({}, 1e-3),
    "lora": (dict(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                                                   "down_proj"]), 3e-3),
    "qlora": (dict(r=8, alpha=16, bits=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                          "gate_proj", "down_proj"]), 3e-3),
    "prefix": (dict(num_virtual_tokens=16), 1e-2),
    "prompt": (dict(num_virtual_tokens=16), 3e-2),
    "adapter": (dict(bottleneck=16), 3e-3),
    "ia3": (dict(), 3e-2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    args = ap.parse_args()
    folder = setup.base_model()
    data = setup.data(folder, "pycode")
    base = lmkit.load_model(folder)
    r0 = data.evaluate(base)
    rows = [{"method": "base model (no tuning)", "loss": f"{r0['loss']:.3f}", "ppl": f"{r0['perplexity']:.1f}",
             "acc": f"{r0['accuracy']:.3f}", "trainable": "0", "share": "0%", "time": "-"}]
    for name in args.methods:
        settings, lr = METHODS[name]
        torch.manual_seed(0)
        model = lmkit.load_model(folder)
        if name != "full fine-tuning":
            model = get_peft_model(model, name.split()[0], **settings)
        s = trainable_summary(model)
        t = time.perf_counter()
        train_causal_lm(model, data.stream, data.pad, args.steps, args.batch_size, lr=lr, warmup_steps=5)
        seconds = time.perf_counter() - t
        r = data.evaluate(model)
        rows.append({"method": name, "loss": f"{r['loss']:.3f}", "ppl": f"{r['perplexity']:.1f}",
                     "acc": f"{r['accuracy']:.3f}", "trainable": f"{s['trainable']:,}",
                     "share": f"{s['percent']:.2f}%", "time": f"{seconds:.0f} s"})
        print(rows[-1], flush=True)
    print(f"\nbase: {folder.name} ({base.num_parameters():,} parameters); {args.steps} steps x batch "
          f"{args.batch_size} x {setup.SEQ_LEN} tokens of pycode; validation: {len(data.val_rows)} rows\n")
    print(machine.describe(["fp32"]))
    print(setup.table(rows, [("method", "method"), ("loss", "val loss"), ("ppl", "perplexity"),
                             ("acc", "next-token acc."), ("trainable", "trainable params"), ("share", "share"),
                             ("time", "train time")]))


if __name__ == "__main__":
    main()
