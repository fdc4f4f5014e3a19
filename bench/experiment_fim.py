""""FIM for free" (Bavarian et al. 2022) at small scale: the same model, data and steps trained on pycode with
`--objective fim --fim-rate 0` and `--fim-rate 0.5`, then

- left-to-right bits per byte on held-out pycode (the run's own validation split: plain next-token scoring);
- infilling exact match on held-out pycode: a middle line of a held-out document is cut out, the model
  infills it greedily from the PSM prompt (lmkit.data.fim.infill_prompt) and the first line it writes is
  compared with the line cut out (whitespace at the ends ignored).

Both runs use --objective fim so that they share the tokenizer, sentinels included (rate 0 never shows them).

    python bench/experiment_fim.py [--steps 400] [--out /tmp/fim-exp] [--cases 200] [--rates 0,0.5]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import machine  # bench/machine.py (the script's folder is on sys.path)

import lmkit
from lmkit.data.corpus import load_corpus
from lmkit.data.fim import infill_bos, infill_prompt
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer

SHAPE = dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, dropout=0.0, attention_dropout=0.0)


def train(rate: float, steps: int, out: Path) -> dict:
    cfg = TrainConfig(preset="tiny", objective="fim", corpus=["pycode"], out=str(out), max_steps=steps, batch_size=16,
                      seq_len=128, lr=3e-3, warmup_steps=steps // 10, vocab_size=1024, precision="fp32", seed=0,
                      save_every=steps, progress=False, model_overrides=SHAPE, fim_rate=rate, fim_spm_rate=0.5)
    start = time.perf_counter()
    result = Trainer(cfg).fit()
    return {"fim_rate": rate, "steps": steps, "val_bpb": result["val_bpb"], "val_loss": result["val_loss"],
            "seconds": round(time.perf_counter() - start)}


def cases(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(prefix, middle line, suffix) from held-out pycode documents: one non-blank line each, 300 chars around."""
    _, held = load_corpus(["pycode"]).split(0.05)
    rng = random.Random(seed)
    out = []
    texts = held.texts()
    while len(out) < n:
        lines = rng.choice(texts).split("\n")
        i = rng.randrange(1, max(2, len(lines) - 1))
        if not lines[i].strip() or len(lines[i]) > 80:
            continue
        prefix, suffix = "\n".join(lines[:i]) + "\n", "\n" + "\n".join(lines[i + 1:])
        out.append((prefix[-300:], lines[i], suffix[:300]))
    return out


@torch.no_grad()
def infill_exact_match(folder: Path, tests: list[tuple[str, str, str]]) -> float:
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    hits = 0
    for prefix, middle, suffix in tests:
        ids = infill_prompt(tok, prefix, suffix, infill_bos(tok, model.config.bos_token_id))
        ids = ids[-(model.config.max_seq_len - 32):]
        out = model.generate(torch.tensor([ids]), max_new_tokens=32)[0, len(ids):].tolist()
        text = tok.decode(out, skip_special_tokens=True)
        hits += text.split("\n")[0].strip() == middle.strip()
    return hits / len(tests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--out", default="/tmp/fim-exp")
    ap.add_argument("--rates", default="0,0.5", help="the --fim-rate values, comma-separated (default 0,0.5)")
    args = ap.parse_args()
    tests = cases(args.cases)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        out = Path(args.out) / f"rate-{rate}"
        row = train(rate, args.steps, out)
        row["infill_exact_match"] = infill_exact_match(out, tests)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": machine.cpu_name(), "shape": SHAPE, "rows": rows}))


if __name__ == "__main__":
    main()
