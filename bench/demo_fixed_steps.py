"""The demo's two models (what `lmkit demo` trains) with fixed step counts in place of its time budgets, so that
they do not depend on how loaded the machine is: the default preset on pydocs with the demo's TrainConfig for
--steps optimizer steps (530: what the 5-minute budget reaches on a quiet 2-core AMD EPYC in bf16), then the demo's
SFT stage on pydocs-instruct (ChatML, packed, batch 16, lr 1e-3, 10 warm-up steps) for --sft-steps (258: what its
150 s reach there). Writes OUT (the base) and OUT/sft, and prints the demo's validation figures and SFT table.

    OMP_NUM_THREADS=1 python bench/demo_fixed_steps.py [--out runs/demo-fixed] [--steps 530] [--sft-steps 258]

The models are then the input of bench/harness_shots.py (--model OUT --model OUT/sft --chat OUT/sft).
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo-fixed")
    ap.add_argument("--steps", type=int, default=530)
    ap.add_argument("--sft-steps", type=int, default=258)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from lmkit.cli.demo import instruction_tune
    from lmkit.cli.train import summary
    from lmkit.data import load_corpus
    from lmkit.evaluate import evaluate_text
    from lmkit.train import TrainConfig, Trainer

    start = time.perf_counter()
    cfg = TrainConfig(preset="default", corpus=["pydocs"], out=args.out, max_steps=args.steps, seed=args.seed)
    trainer = Trainer(cfg)
    print(f"{trainer.model.num_parameters() / 1e6:.2f}M parameters, precision {trainer.cfg.precision}", flush=True)
    print(summary(trainer.fit(), args.out), flush=True)
    _, val = load_corpus(["pydocs"]).split(trainer.cfg.val_fraction)
    r = evaluate_text(trainer.model.eval(), trainer.tokenizer, val, precision="fp32")
    print(f"validation (fp32): loss {r['loss']:.4f} nats/token, bits per byte {r['bpb']:.4f}; "
          f"pre-training took {time.perf_counter() - start:.0f} s", flush=True)
    instruction_tune(trainer.out, None, args.seed, trainer.bos_id, steps=args.sft_steps)
    print(f"all done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
