"""The shape `lmkit train --time-budget S` trains for each budget S on this machine: every shape of the default
preset's ridge (1x64 to 8x512) timed once in the default recipe (24 x 128-token batches, this CPU's default
precision, Muon), then the pydocs scaling law's choice per budget (train/sizing.py's walk, which this table
also checks against the exhaustive minimum).

    python bench/sizing_table.py [--budgets 60 300 900 3600 14400] [--max-layers 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[60, 300, 900, 3600, 14400])
    ap.add_argument("--max-layers", type=int, default=8)
    args = ap.parse_args()

    from lmkit.scaling.laws import PYDOCS
    from lmkit.train import TrainConfig
    from lmkit.train import sizing
    from lmkit.train.setup import prepare_training
    from lmkit.train.trainer import Trainer

    setup = prepare_training(TrainConfig(out=tempfile.mkdtemp() + "/run", time_budget=300.0, progress=False,
                                         sizing="off"))
    print(machine.describe([setup.cfg.precision]))
    timed = {}
    for layers in range(1, args.max_layers + 1):
        shape = sizing.ridge_shape(layers)
        timed[layers] = sizing.measure(setup, shape, lambda s: Trainer(s.cfg, setup=s))
        print(f"{shape.name}: N = {timed[layers][0]:,}, {timed[layers][1]:,.0f} tokens/s", flush=True)
    tokens_per_step = setup.cfg.batch_size * setup.cfg.seq_len
    print(f"\n| budget | shape | N (non-embedding) | tokens/s | steps | tokens per parameter | predicted loss |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for budget in args.budgets:
        best, _ = sizing.choose(PYDOCS, budget, tokens_per_step, 4,
                                lambda shape: timed[shape.n_layers], max_layers=args.max_layers)
        exhaustive = min(timed, key=lambda k: PYDOCS.loss(timed[k][0], timed[k][1] * budget)
                         if timed[k][1] * budget >= sizing.MIN_STEPS * tokens_per_step else float("inf"))
        n, rate = timed[best.shape.n_layers]
        note = "" if exhaustive == best.shape.n_layers else f" (exhaustive: {sizing.ridge_shape(exhaustive).name})"
        print(f"| {budget:g} s | {best.shape.name}{note} | {n:,} | {rate:,.0f} | {rate * budget / tokens_per_step:,.0f} "
              f"| {rate * budget / n:.1f} | {best.predicted_loss:.3f} |")


if __name__ == "__main__":
    main()
