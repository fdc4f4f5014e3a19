"""XLNet-tiny pre-trained with permutation LM against BERT-tiny with masked LM, the same time each on pydocs, then
both fine-tuned on the same built-in classification task: is a pydocs sentence in its own word order or shuffled?

    PYTHONPATH=src python bench/bench_xlnet_plm.py [--minutes 5] [--out runs/xlnet-vs-bert]

The task is deterministic: sentences of 8 to 30 words from pydocs, half of them with their words shuffled (seeded);
the classifier trains on sentences of pre-training's documents and is tested on those of its validation documents,
which neither model saw.
Prints one row per model: pre-training steps, validation bits per byte of its own objective (PLM scores 1/6 of
the tokens, MLM 15%: not comparable with each other nor with a causal model's), and the classifier's accuracy
and macro-F1. Both runs see the same batches (16 x 128 tokens) and the same fine-tuning settings; a control row per
model fine-tunes a random initialisation of it the same way, to show what pre-training adds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402




def word_order_task(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of {"text", "label": "original" | "shuffled"}: pydocs' training and validation
    documents."""
    from lmkit.data.corpus import load_corpus

    train, val = load_corpus("pydocs").split()  # the split pre-training uses: its validation documents are unseen
    rng = random.Random(seed)
    paths = []
    for name, part in (("train", sorted(train.documents, key=lambda d: d.id)),
                       ("test", sorted(val.documents, key=lambda d: d.id))):
        rows = []
        for doc in part:
            for sentence in re.split(r"(?<=[.!?])\s+", doc.text):
                words = sentence.split()
                if not 8 <= len(words) <= 30:
                    continue
                label = rng.choice(("original", "shuffled"))
                if label == "shuffled":
                    while True:
                        shuffled = rng.sample(words, len(words))
                        if shuffled != words:
                            break
                    words = shuffled
                rows.append({"text": " ".join(words), "label": label})
        rng.shuffle(rows)
        rows = rows[:3000 if name == "train" else 1000]
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="pre-training time of each model")
    parser.add_argument("--out", default="runs/xlnet-vs-bert")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    import torch

    from lmkit.finetune.classify import FinetuneConfig, finetune
    from lmkit.hub import load_model
    from lmkit.models import build_model
    from lmkit.train.config import TrainConfig
    from lmkit.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = word_order_task(out)
    rows = []
    for preset, objective in (("xlnet-tiny", "plm"), ("bert-tiny", "mlm")):
        run = out / preset
        cfg = TrainConfig(preset=preset, objective=objective, corpus=["pydocs"], out=str(run), batch_size=16,
                          seq_len=128, lr=1e-3, time_budget=args.minutes * 60, seed=0, precision="fp32",
                          log_every=50, progress=False)
        result = Trainer(cfg).fit()
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last_eval = [m for m in metrics if "val_bpb" in m][-1]
        best = finetune(FinetuneConfig(model=str(run), train=str(train), eval=str(test), out=str(out / f"{preset}-cls"),
                                       epochs=args.epochs, lr=3e-4, batch_size=32, seed=0, progress=False))
        rows.append((preset, objective, result.get("step", last_eval["step"]), f"{last_eval['val_bpb']:.3f}",
                     best["accuracy"], best["macro_f1"]))
        # the control: the same fine-tuning from a random initialisation of the same model and tokenizer
        torch.manual_seed(0)
        fresh = build_model(load_model(run).config)
        fresh.save_pretrained(out / f"{preset}-init")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (run / name).exists():
                shutil.copy(run / name, out / f"{preset}-init" / name)
        best = finetune(FinetuneConfig(model=str(out / f"{preset}-init"), train=str(train), eval=str(test),
                                       out=str(out / f"{preset}-init-cls"), epochs=args.epochs, lr=3e-4, batch_size=32,
                                       seed=0, progress=False))
        rows.append((f"{preset}, not pre-trained", "none", 0, "-", best["accuracy"], best["macro_f1"]))
    print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}) (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"pre-training: {args.minutes:g} min each on pydocs, batch 16 x 128, AdamW lr 1e-3, fp32; fine-tuning: "
          f"{args.epochs} epochs, lr 3e-4, batch 32 on {sum(1 for _ in open(train))} train / "
          f"{sum(1 for _ in open(test))} test sentences")
    print("| model | objective | steps | val bits/byte (own objective) | accuracy | macro-F1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset, objective, steps, bpb, acc, f1 in rows:
        print(f"| {preset} | {objective} | {steps} | {bpb} | {acc:.3f} | {f1:.3f} |")


if __name__ == "__main__":
    main()
