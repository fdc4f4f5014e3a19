"""Experiment 1, nanochat's RL stage at small scale: the chain-of-thought addition model of experiment_cot.py after
SFT, then GRPO on addition with the exact-answer reward for a fixed time, against the same time spent on more SFT
(the same prompts, completed by their reference traces).

Exact match (the harness's strict "The answer is N") by number of digits on the addition_cot_d* test problems,
greedy through the Engine, before and after each arm, and GRPO's reward curve (OUT/grpo/metrics.jsonl).

    nice -n 19 python bench/experiment_grpo.py --cot-out runs/cot-experiment   # the model experiment_cot.py trained
    nice -n 19 python bench/experiment_grpo.py --quick                         # a small CoT model trained here first

Writes OUT/table.md and OUT/results.json; steps already done are reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_cot as cot  # noqa: E402

import lmkit  # noqa: E402
from lmkit.evaluate.harness_tasks.lmkit_tasks import addition_splits, addition_trace  # noqa: E402
from lmkit.finetune.grpo import GRPOConfig, grpo  # noqa: E402
from lmkit.finetune.grpo_data import addition_prompts  # noqa: E402
from lmkit.finetune.rewards import exact_answer  # noqa: E402
from lmkit.finetune.sft import SFTConfig, sft  # noqa: E402

DIGITS = (1, 2, 3, 4)


def exact_match(folder: Path, limit: int, max_new_tokens: int = 80) -> dict[str, float]:
    """Greedy exact match by digits on the first `limit` test problems of addition_cot_d{1..4} (zero-shot)."""
    from lmkit.generation import GenerationConfig
    from lmkit.generation.engine import Engine, Request

    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder / "tokenizer.json")
    engine = Engine(model, max_batch=32)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, stop_strings=["\n"])
    out = {}
    for d in DIGITS:
        pairs = addition_splits(d)[0][:limit]
        requests = [Request(prompt=tok.encode(f"Question: {a}+{b}\nAnswer:"), config=config, tokenizer=tok)
                    for a, b in pairs]
        engine.run_all(requests)
        texts = [tok.decode(r.output, skip_special_tokens=True) for r in requests]
        scores = exact_answer(None, texts, [str(a + b) for a, b in pairs])
        out[str(d)] = sum(scores) / len(scores)
    return out


def quick_cot_model(out: Path, steps: int) -> Path:
    """A small CoT model trained by experiment_cot's functions (fewer problems and steps, 2 x 64)."""
    model = out / "model-cot"
    if cot.trained_steps(model) < steps:
        args = argparse.Namespace(preset="tiny", layers=2, d_model=64, heads=4, steps=steps, batch_size=16,
                                  seq_len=256, lr=3e-3, warmup=30, precision="fp32", seed=0)
        corpora = cot.write_corpora(out / "corpus", 3000, 0)
        tokenizer = cot.write_tokenizer(out / "tokenizer.json", corpora, 320)
        shards = cot.prepare_shards(out / "shards-cot", corpora["cot"], tokenizer)
        from lmkit.train import train

        cfg = cot.train_config(args, shards, model)
        cfg.resume = cot.trained_steps(model) > 0
        train(cfg)
    return model


def sft_rows(path: Path, count: int) -> Path:
    """The GRPO prompts completed by their reference traces, as prompt/completion rows."""
    rows = addition_prompts()[:count]
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            a, b = map(int, r["prompt"].removeprefix("Question: ").removesuffix("\nAnswer:").split("+"))
            f.write(json.dumps({"prompt": r["prompt"], "completion": " " + addition_trace(a, b)}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cot-out", help="experiment_cot.py's --out (its model-cot is the starting model)")
    ap.add_argument("--quick", action="store_true", help="train a small CoT model here first")
    ap.add_argument("--quick-steps", type=int, default=400)
    ap.add_argument("--out", default="runs/grpo-experiment")
    ap.add_argument("--grpo-steps", type=int, default=40)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="completions per GRPO step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--limit", type=int, default=50, help="test problems per number of digits")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = quick_cot_model(out, args.quick_steps) if args.quick else Path(args.cot_out) / "model-cot"
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    if "before" not in results:
        results["before"] = exact_match(start, args.limit)
    if "grpo" not in results:
        t, cpu = time.perf_counter(), time.process_time()
        grpo(GRPOConfig(model=str(start), prompts="addition-cot", reward="exact-answer", out=str(out / "grpo"),
                        num_generations=args.generations, batch_size=args.batch, max_steps=args.grpo_steps,
                        max_completion_length=80, lr=args.lr, precision="fp32"), log=print)
        results["grpo_seconds"] = time.perf_counter() - t
        results["grpo_cpu_seconds"] = time.process_time() - cpu
        results["grpo"] = exact_match(out / "grpo", args.limit)
    if "sft" not in results:
        cpu = time.process_time()
        sft(SFTConfig(model=str(start), train=str(sft_rows(out / "sft.jsonl", 4000)), out=str(out / "sft"),
                      max_steps=10**6, time_budget=results["grpo_seconds"], batch_size=args.batch // 2, lr=args.lr,
                      precision="fp32", warmup_ratio=0.0))
        results["sft_cpu_seconds"] = time.process_time() - cpu
        results["sft"] = exact_match(out / "sft", args.limit)
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    rewards = [json.loads(line)["reward"] for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    lines = ["| model | " + " | ".join(f"{d} digit{'s' * (d > 1)}" for d in DIGITS) + " |",
             "| --- |" + " ---: |" * len(DIGITS)]
    for name, key in (("after SFT", "before"), (f"+ GRPO ({args.grpo_steps} steps)", "grpo"),
                      ("+ more SFT, same time", "sft")):
        lines.append(f"| {name} | " + " | ".join(f"{results[key][str(d)]:.2f}" for d in DIGITS) + " |")
    cpu = {arm: results.get(f"{arm}_cpu_seconds", 0.0) for arm in ("grpo", "sft")}
    lines.append(f"\nGRPO: {results['grpo_seconds']:.0f} s wall, {cpu['grpo']:.0f} s CPU; "
                 f"more SFT: {cpu['sft']:.0f} s CPU; mean reward by step: " + " ".join(f"{r:.2f}" for r in rewards))
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
