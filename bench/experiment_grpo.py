"""Experiment 1, nanochat's RL stage at small scale: the chain-of-thought addition model of experiment_cot.py after
SFT, then GRPO on addition with the exact-answer reward (one arm per --grpo-lrs value, the same steps each), against
about the same CPU time spent on more SFT (the same prompts, completed by their reference traces).

Exact match (the harness's strict "The answer is N") by number of digits on the addition_cot_d* test problems,
greedy through the Engine, before and after each arm; each GRPO arm's metrics.jsonl (reward, KL, entropy, and
`weight_move`, the L2 norm of the step's change to the weights) and the reward curve (OUT/reward.png).

    nice -n 10 python bench/experiment_grpo.py --cot-out runs/cot-full --out runs/grpo-recipe   # the documented run
    # the first run's recipe, exact match traced at steps 4..40, with and without AdamW's zero-gradient steps:
    nice -n 10 python bench/experiment_grpo.py --cot-out runs/cot-full --out runs/grpo-zero --grpo-lrs 1e-4 --beta 0 \\
        --generations 8 --batch 32 --digits 1,2,3,4 --grpo-steps 40 --trace-steps 3,4,10,40 --no-sft [--skip-zero-steps]
    nice -n 10 python bench/experiment_grpo.py --quick     # a small CoT model trained here first

Writes OUT/table.md and OUT/results.json; arms already done are reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_cot as cot  # noqa: E402

import lmkit  # noqa: E402
from lmkit.evaluate.harness_tasks.lmkit_tasks import addition_splits, addition_trace  # noqa: E402
from lmkit.finetune.grpo import GRPOConfig, GRPOJob  # noqa: E402
from lmkit.finetune.grpo_data import ADDITION_STOP, addition_prompts  # noqa: E402
from lmkit.finetune.rewards import exact_answer  # noqa: E402
from lmkit.finetune.sft import SFTConfig, sft  # noqa: E402
from lmkit.train import distributed  # noqa: E402

DIGITS = (1, 2, 3, 4)


def exact_match(model, tok, limit: int, digits=DIGITS, max_new_tokens: int = 80) -> dict[str, float]:
    """Greedy exact match by digits on the first `limit` test problems of addition_cot_d{digits} (zero-shot)."""
    from lmkit.generation import GenerationConfig
    from lmkit.generation.engine import Engine, Request

    was_training = model.training
    engine = Engine(model, max_batch=32)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, stop_strings=["\n"])
    out = {}
    for d in digits:
        pairs = addition_splits(d)[0][:limit]
        requests = [Request(prompt=tok.encode(f"Question: {a}+{b}\nAnswer:"), config=config, tokenizer=tok)
                    for a, b in pairs]
        engine.run_all(requests)
        texts = [tok.decode(r.output, skip_special_tokens=True) for r in requests]
        scores = exact_answer(None, texts, [str(a + b) for a, b in pairs])
        out[str(d)] = sum(scores) / len(scores)
    model.train(was_training)
    return out


def folder_exact_match(folder: Path, limit: int) -> dict[str, float]:
    return exact_match(lmkit.load_model(folder), lmkit.load_tokenizer(folder / "tokenizer.json"), limit)


class TracedGRPO(GRPOJob):
    """lmkit's GRPO job, recording each step's weight move and, at the trace steps, greedy exact match (its CPU time
    kept apart); `skip_zero_steps`: no optimizer step where the gradient is exactly zero (a diagnostic, not TRL's
    behaviour: transformers' Trainer steps AdamW every step)."""

    def __init__(self, config, trace_steps=(), trace_limit=30, skip_zero_steps=False):
        super().__init__(config, distributed.setup(None))
        self.stop = list(ADDITION_STOP)  # prompts from a file: still one line of answer each
        self.trace_steps, self.trace_limit, self.skip_zero_steps = set(trace_steps), trace_limit, skip_zero_steps
        self.previous = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.trace_cpu = 0.0

    def build_optimizer(self):
        optimizer = super().build_optimizer()
        if self.skip_zero_steps:
            step = optimizer.step

            def step_unless_zero(*args, **kwargs):
                if all(p.grad is None or not p.grad.any() for g in optimizer.param_groups for p in g["params"]):
                    return None
                return step(*args, **kwargs)
            optimizer.step = step_unless_zero
        return optimizer

    def step_row(self, loop, seconds, result):
        row = super().step_row(loop, seconds, result)
        with torch.no_grad():
            move = sum(float(((v - self.previous[k]) ** 2).sum()) for k, v in self.model.named_parameters())
            self.previous = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        row["weight_move"] = move ** 0.5
        if loop.step in self.trace_steps:
            cpu = time.process_time()
            row["exact_match"] = exact_match(self.model, self.tok, self.trace_limit, digits=(1, 2, 3))
            self.trace_cpu += time.process_time() - cpu
        return row


def reward_probe(folder: Path, per_digits: int, samples: int, temperature: float) -> dict:
    """How the exact-answer reward meets the model's own samples: `samples` completions at `temperature` of each of
    `per_digits` training prompts per digit count; the share that has the "The answer is N" form the reward reads,
    the share the reward scores 1, and the share of groups of 8 and of 16 whose rewards differ (a GRPO signal)."""
    import re

    from lmkit.generation import GenerationConfig
    from lmkit.generation.engine import Engine, Request

    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder / "tokenizer.json")
    engine = Engine(model, max_batch=64)
    config = GenerationConfig(do_sample=True, temperature=temperature, max_new_tokens=80, stop_strings=["\n"])
    out = {}
    for d in DIGITS:
        rows = addition_prompts(digits=(d,))[:per_digits]
        requests = [Request(prompt=tok.encode(r["prompt"]), config=config, tokenizer=tok, seed=1000 * i + j)
                    for i, r in enumerate(rows) for j in range(samples)]
        engine.run_all(requests)
        texts = [tok.decode(r.output, skip_special_tokens=True) for r in requests]
        scores = exact_answer(None, texts, [r["answer"] for r in rows for _ in range(samples)])
        groups = [scores[i * samples:(i + 1) * samples] for i in range(len(rows))]
        mixed = {g: sum(len(set(s[k:k + g])) > 1 for s in groups for k in range(0, samples, g)) / (
            len(groups) * (samples // g)) for g in (8, 16) if samples % g == 0}
        out[str(d)] = {"form": sum(bool(re.search(r"The answer is -?[0-9]+", t)) for t in texts) / len(texts),
                       "reward": sum(scores) / len(scores), "mixed_groups": mixed}
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


def write_rows(out: Path, digits: tuple[int, ...]) -> tuple[Path, Path]:
    """The GRPO prompts of `digits` (rows of the built-in addition-cot task) and the same prompts completed by their
    reference traces as SFT's prompt/completion rows."""
    rows = addition_prompts(digits=digits)
    prompts, completions = out / "prompts.jsonl", out / "sft.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with open(completions, "w", encoding="utf-8") as f:
        for r in rows:
            a, b = map(int, r["prompt"].removeprefix("Question: ").removesuffix("\nAnswer:").split("+"))
            f.write(json.dumps({"prompt": r["prompt"], "completion": " " + addition_trace(a, b)}) + "\n")
    return prompts, completions


def grpo_arm(args, start: Path, prompts: Path, out: Path, lr: float) -> dict:
    config = GRPOConfig(model=str(start), prompts=str(prompts), reward="exact-answer", out=str(out),
                        num_generations=args.generations, batch_size=args.batch, max_steps=args.grpo_steps,
                        max_completion_length=80, lr=lr, beta=args.beta, temperature=args.temperature,
                        precision="fp32", seed=args.seed)
    cpu = time.process_time()
    job = TracedGRPO(config, args.trace_steps, args.trace_limit, args.skip_zero_steps)
    try:
        job.run(print)
    finally:
        job.close()
    return {"lr": lr, "cpu_seconds": time.process_time() - cpu - job.trace_cpu, "exact": exact_match(
        job.model, job.tok, args.limit)}


def plot(out: Path, arms: dict[str, Path]) -> None:
    """Each GRPO arm's reward by step (thin) and its 20-step running mean, and the KL to the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for name, folder in arms.items():
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        steps, reward = [r["step"] for r in rows], [r["reward"] for r in rows]
        mean = [sum(reward[max(0, i - 19):i + 1]) / len(reward[max(0, i - 19):i + 1]) for i in range(len(reward))]
        line, = top.plot(steps, mean, label=name, linewidth=2)
        top.plot(steps, reward, color=line.get_color(), alpha=0.25, linewidth=0.8)
        if "kl" in rows[0]:
            bottom.plot(steps, [r["kl"] for r in rows], color=line.get_color(), label=name)
        else:
            bottom.plot(steps, [r["entropy"] for r in rows], color=line.get_color(), linestyle=":",
                        label=f"{name}: entropy")
    top.set_ylabel("mean reward (exact answer)")
    top.set_title("GRPO on addition: reward by step (thin) and its 20-step mean")
    top.legend(fontsize=8)
    bottom.set_ylabel("KL to the start (k3)")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cot-out", help="experiment_cot.py's --out (its model-cot is the starting model)")
    ap.add_argument("--quick", action="store_true", help="train a small CoT model here first")
    ap.add_argument("--quick-steps", type=int, default=400)
    ap.add_argument("--out", default="runs/grpo-experiment")
    ap.add_argument("--grpo-steps", type=int, default=200)
    ap.add_argument("--grpo-lrs", default="1e-5,1e-4", help="one GRPO arm per learning rate")
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="completions per GRPO step")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (DeepSeekMath's 0.04)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--digits", default="1,2,3", help="digit counts of the training prompts of both arms")
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--no-sft", action="store_true", help="GRPO arms only")
    ap.add_argument("--skip-zero-steps", action="store_true", help="diagnostic: no AdamW step on a zero gradient")
    ap.add_argument("--trace-steps", default="", help="GRPO steps at which to record exact match (1-3 digits)")
    ap.add_argument("--trace-limit", type=int, default=30)
    ap.add_argument("--limit", type=int, default=50, help="test problems per number of digits")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward-probe", type=int, metavar="N", help="only probe the reward on N prompts per digit count")
    args = ap.parse_args()
    args.trace_steps = [int(s) for s in args.trace_steps.split(",") if s]
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = quick_cot_model(out, args.quick_steps) if args.quick else Path(args.cot_out) / "model-cot"
    if args.reward_probe:
        probe = reward_probe(start, args.reward_probe, 16, args.temperature)
        (out / "reward_probe.json").write_text(json.dumps(probe, indent=2), encoding="utf-8")
        return print(json.dumps(probe, indent=2))
    prompts, sft_rows = write_rows(out, tuple(int(d) for d in args.digits.split(",")))
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    save = lambda: (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")  # noqa: E731
    if "before" not in results:
        results["before"] = folder_exact_match(start, args.limit)
        save()
    arms = {}
    for lr in (float(x) for x in args.grpo_lrs.split(",")):
        name = f"GRPO lr {lr:g}"
        arms[name] = out / f"grpo-lr{lr:g}"
        if name not in results:
            results[name] = grpo_arm(args, start, prompts, arms[name], lr)
            save()
    grpo_cpu = max(results[name]["cpu_seconds"] for name in arms)
    if not args.no_sft and "sft" not in results:
        cpu = time.process_time()
        # the loop's time budget counts process CPU seconds here: the machine is shared, and wall time would give
        # this arm less CPU than the GRPO arm had
        with mock.patch.object(time, "perf_counter", time.process_time):
            report = sft(SFTConfig(model=str(start), train=str(sft_rows), out=str(out / "sft"),
                                   max_steps=10**6,
                                   time_budget=grpo_cpu, batch_size=args.sft_batch, lr=args.sft_lr,
                                   precision="fp32", warmup_ratio=0.0))
        results["sft"] = {"cpu_seconds": time.process_time() - cpu, "steps": report.get("steps"),
                          "exact": folder_exact_match(out / "sft", args.limit)}
        save()
    plot(out, arms)
    lines = ["| model | CPU s | " + " | ".join(f"{d} digit{'s' * (d > 1)}" for d in DIGITS) + " |",
             "| --- | ---: |" + " ---: |" * len(DIGITS),
             "| after SFT (start) | | " + " | ".join(f"{results['before'][str(d)]:.2f}" for d in DIGITS) + " |"]
    for name in list(arms) + ([] if args.no_sft else ["sft"]):
        label = f"+ {name} ({args.grpo_steps} steps)" if name != "sft" else "+ more SFT, same CPU"
        r = results[name]
        lines.append(f"| {label} | {r['cpu_seconds']:.0f} | " + " | ".join(f"{r['exact'][str(d)]:.2f}"
                                                                           for d in DIGITS) + " |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
