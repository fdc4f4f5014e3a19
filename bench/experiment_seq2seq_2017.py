"""The 2017 Transformer against T5 and BART at one size, and exposure bias with and without scheduled sampling
(issue 39); runs cached under $LMKIT_BENCH_DIR/enccomp.

    python bench/experiment_seq2seq_2017.py [--steps N] [--schedule KIND:K] [--part bleu|exposure|both]

1. BLEU: `transformer-2017-mt`, `t5-tiny` and `bart` made the same size (d 128, 3 + 3 layers, 4 heads, d_ff 512,
   no dropout: a short run on 20,000 pairs does not overfit), trained by `fit_pairs` on the numbers task
   (lmkit.data.translation) for the same steps, batch, learning rate and warm-up; corpus BLEU (sacrebleu) of greedy
   outputs on the 500 held-out numbers. Each keeps its own architecture (post-LN + ReLU + sinusoidal; pre-RMSNorm +
   relative buckets; post-LN + GELU + learned positions + embedding LayerNorm).
2. Exposure bias (Bengio et al. 2015): teacher-forced token accuracy (the reference prefix in, argmax against the
   next reference token) against free-running accuracy (greedy decoding, position t of the output against
   position t of the reference, missing tokens wrong) on the same held-out targets. On the numbers task: t5-tiny
   of part 1 against the same run with `scheduled_sampling=KIND:K`; on pydocs: the `tiny` causal preset trained
   with and without `lmkit train --scheduled-sampling KIND:K`, scored on held-out rows, 64 tokens of prefix
   and 16 continued (greedy) or teacher-forced.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compress_setup as setup  # noqa: E402
import machine  # noqa: E402

import lmkit  # noqa: E402
from lmkit.data.translation import make_pairs, task_tokenizer  # noqa: E402
from lmkit.evaluate.seq2seq import encode_pairs, encode_target, translate  # noqa: E402
from lmkit.finetune.clm import CausalLMData  # noqa: E402
from lmkit.objectives import IGNORE_INDEX, seq2seq_batch  # noqa: E402
from lmkit.train.translation import fit_pairs  # noqa: E402

OUT = setup.BENCH_DIR / "enccomp"
SIZE = dict(d_model=128, n_layers=3, n_heads=4, head_dim=32, d_ff=512, max_seq_len=64, dropout=0.0)
PRESETS = {
    "transformer-2017-mt": dict(SIZE, embedding_scale=128 ** 0.5),  # the paper's sqrt(d_model) at this width
    "t5-tiny": dict(SIZE),
    "bart": dict(SIZE, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id="eos"),
}


def pairs_run(preset: str, steps: int, schedule: str | None = None) -> Path:
    """fit_pairs of one preset (cached); the folder holds the model, metrics.jsonl and bench.json."""
    out = OUT / (f"numbers-{preset}-{steps}" + (f"-ss-{schedule.replace(':', '')}" if schedule else ""))
    if (out / "bench.json").exists():
        return out
    train, test = make_pairs(20000, 500, seed=0)
    tok = task_tokenizer()
    overrides = dict(PRESETS[preset])
    if overrides.get("decoder_start_token_id") == "eos":  # BART's decoder starts from </s>
        overrides["decoder_start_token_id"] = tok.token_to_id("</s>")
    t = time.process_time()
    result = fit_pairs(train, test, tok, out, preset=preset, steps=steps, batch_size=64, lr=1e-3, warmup_steps=50,
                       eval_every=steps, seed=0, log_every=50, scheduled_sampling=schedule, **overrides)
    (out / "bench.json").write_text(json.dumps({**result, "cpu_s": time.process_time() - t}))
    return out


@torch.no_grad()
def pairs_exposure(folder: Path) -> dict:
    """Teacher-forced and free-running token accuracy on the held-out pairs."""
    _, test = make_pairs(20000, 500, seed=0)
    model, tok = lmkit.load_model(folder).eval(), task_tokenizer()
    batch = seq2seq_batch(*encode_pairs(model, tok, test), model.config.pad_token_id)
    labels = batch["labels"]
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).logits
    real = labels != IGNORE_INDEX
    forced = float((logits.argmax(-1) == labels)[real].float().mean())
    hyps = [encode_target(model, tok, h) for h in translate(model, tok, [s for s, _ in test])]
    right = sum(sum(a == b for a, b in zip(h, r[r != IGNORE_INDEX].tolist())) for h, r in zip(hyps, labels))
    return {"teacher_forced": forced, "free_running": right / int(real.sum())}


def causal_run(steps: int, schedule: str | None, seed: int = 0) -> Path:
    out = OUT / (f"pydocs-tiny-{steps}" + (f"-ss-{schedule.replace(':', '')}" if schedule else "")
                 + (f"-s{seed}" if seed else ""))
    if not (out / "bench.json").exists():
        from lmkit.train import TrainConfig, Trainer

        cfg = TrainConfig(preset="tiny", corpus=["pydocs"], out=str(out), max_steps=steps, batch_size=16, seq_len=128,
                          precision="fp32", progress=False, seed=seed, save_every=steps, eval_every=steps,
                          scheduled_sampling=schedule)
        t = time.process_time()
        result = Trainer(cfg).fit()
        (out / "bench.json").write_text(json.dumps({**result, "cpu_s": time.process_time() - t}))
    return out


@torch.no_grad()
def causal_exposure(folder: Path, prefix: int = 64, length: int = 16, rows: int = 64) -> dict:
    """Teacher-forced and greedy free-running accuracy of `length` tokens after `prefix` held-out tokens."""
    model = lmkit.load_model(folder).eval()
    data = CausalLMData(lmkit.load_tokenizer(folder / "tokenizer.json"), ["pydocs"], 128, 60)
    full = data.val_mask[:, :prefix + length].all(-1)
    ids = data.val_rows[full][:rows, :prefix + length]
    ref = ids[:, prefix:]
    forced = model(ids).logits[:, prefix - 1:-1].argmax(-1)
    free = model.generate(ids[:, :prefix], max_new_tokens=length, min_new_tokens=length, do_sample=False)[:, prefix:]
    return {"teacher_forced": float((forced == ref).float().mean()),
            "free_running": float((free == ref).float().mean()), "rows": len(ids)}


def bleu_at(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "bleu" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, metavar="N", help="training steps of every run (200)")
    ap.add_argument("--schedule", default="inverse_sigmoid:30", metavar="KIND:K",
                    help="the scheduled-sampling decay (inverse_sigmoid:30: eps 0.5 near step 102, 0.04 at 200)")
    ap.add_argument("--part", default="both", choices=["bleu", "exposure", "both"], metavar="PART",
                    help="bleu: the three presets' table; exposure: the exposure-bias table; both (default)")
    ap.add_argument("--pydocs-seed", type=int, default=0, metavar="N", help="seed of the pydocs runs (0)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [] if args.part != "exposure" else None
    if rows is not None:
        bleu_table(args, rows)
    if args.part == "bleu":
        (OUT / f"seq2seq_bleu_{args.steps}.json").write_text(json.dumps({"bleu": rows}, indent=1))
        return
    exposure_table(args, rows)


def bleu_table(args, rows: list) -> None:
    for preset in PRESETS:
        folder = pairs_run(preset, args.steps)
        bench, evals = json.loads((folder / "bench.json").read_text()), bleu_at(folder)
        model = lmkit.load_model(folder)
        rows.append({"preset": preset, "params": f"{model.num_parameters():,}", "cpu": f"{bench['cpu_s']:.0f} s",
                     **{f"bleu{s}": f"{r['bleu']:.1f}" for s, r in evals.items()},
                     "val_loss": f"{bench['val_loss']:.3f}", "exact": f"{100 * bench['exact_match']:.1f}%"})
        print(rows[-1], flush=True)
    print(f"\nnumbers task, {args.steps} steps x batch 64, lr 1e-3, warm-up 50, fp32, 1 thread\n")
    print(machine.describe(["fp32"]))
    print(setup.table(rows, [("preset", "preset"), ("params", "parameters"), (f"bleu{args.steps}", "BLEU"),
                             ("val_loss", "held-out loss"),
                             ("exact", "exact match"), ("cpu", "train CPU")]))


def exposure_table(args, rows) -> None:
    table = []
    for task, run, score in (("numbers (t5-tiny)", lambda s: pairs_run("t5-tiny", args.steps, s), pairs_exposure),
                             ("pydocs (tiny, causal)", lambda s: causal_run(args.steps, s, args.pydocs_seed),
                              causal_exposure)):
        for schedule in (None, args.schedule):
            folder = run(schedule)
            r = score(folder)
            bench = json.loads((folder / "bench.json").read_text())
            table.append({"task": task, "training": schedule or "teacher forcing", **r,
                          "gap": r["teacher_forced"] - r["free_running"], "cpu_s": bench["cpu_s"],
                          "bleu": bench.get("bleu"), "val_loss": bench.get("val_loss")})
            print(table[-1], flush=True)
    for r in table:
        for k in ("teacher_forced", "free_running", "gap"):
            r[k + "_s"] = f"{r[k]:.3f}"
        r["cpu"] = f"{r['cpu_s']:.0f} s"
        r["extra"] = f"BLEU {r['bleu']:.1f}" if r["bleu"] is not None else f"val loss {r['val_loss']:.3f}"
    print(setup.table(table, [("task", "task"), ("training", "training"), ("teacher_forced_s", "teacher-forced acc."),
                              ("free_running_s", "free-running acc."), ("gap_s", "gap"), ("extra", "held-out"),
                              ("cpu", "train CPU")]))
    (OUT / f"seq2seq_results_{args.steps}_s{args.pydocs_seed}.json").write_text(json.dumps({"bleu": rows, "exposure": table}, indent=1))


if __name__ == "__main__":
    main()
