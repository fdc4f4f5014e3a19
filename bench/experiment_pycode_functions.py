"""A model trained here that scores above zero on `pycode_functions`: a 2-layer causal LM trained on the task's 40
exemplar functions (its `train` split) mixed with pycode, then `lmkit harness --tasks pycode_functions` (3 exemplars,
greedy, every completion run in the sandbox) on the 124 scored problems, none of them trained on.

    python bench/experiment_pycode_functions.py [--steps 300] [--mix 0.8] [--out /tmp/pycode-functions-model]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import machine  # bench/machine.py (the script's folder is on sys.path)
from experiment_code_model import SHAPE, exemplars_file

from lmkit.evaluate.harness_run import run as harness_run
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mix", type=float, default=0.8, help="share of rows from the exemplar functions (rest pycode)")
    ap.add_argument("--out", default="/tmp/pycode-functions-model")
    args = ap.parse_args()
    out = Path(args.out)
    exemplars = exemplars_file(out.parent / (out.name + "-data"))
    cfg = TrainConfig(preset="tiny", objective="clm", corpus=[f"pycode:{1 - args.mix}", f"{exemplars}:{args.mix}"],
                      out=str(out), max_steps=args.steps, batch_size=16, seq_len=384, lr=3e-3,
                      warmup_steps=args.steps // 10, vocab_size=512, precision="fp32", seed=0, save_every=args.steps,
                      progress=False, model_overrides=dict(SHAPE, n_layers=2, max_seq_len=384))
    start = time.process_time()
    trained = Trainer(cfg).fit()
    cpu = time.process_time() - start
    scores = harness_run(str(out), ["pycode_functions"], batch_size=16)["results"]["pycode_functions"]
    row = {"steps": args.steps, "mix": args.mix, "val_bpb": round(trained["val_bpb"], 4),
           "train_cpu_seconds": round(cpu), "pass@1": scores["pass@1,sandbox"], "cpu": machine.cpu_name()}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
