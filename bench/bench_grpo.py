"""GRPO steps side by side: `lmkit finetune --task grpo`'s job against TRL's GRPOTrainer (no vLLM: its rollouts use
transformers' generate), the same GPT-2 folder, prompts (the built-in addition-cot task), reward (exact answer),
G, completions per step and completion length, fp32, one process each in turn in this one run. Both draw the
steps' prompts from the same first rows of the built-in addition-cot task (lmkit in its seeded shuffled order).

Reports prompts per second of whole optimizer steps (rollouts, rewards, reference pass, loss, backward, update),
the median over the timed steps after the first (which warms caches), and the ratio; also the ratio of the fastest
steps, which other work on a shared machine disturbs least. Steps are timed in the
process's CPU time (one thread), which a machine loaded by other work inflates far less than wall time.

    nice -n 19 python bench/bench_grpo.py [--steps 5] [--width 128] [--layers 4] [--completion 64] [--threads 1]
        [--eos-logit 0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

import lmkit  # noqa: E402
from lmkit.finetune.grpo import GRPOConfig, GRPOJob  # noqa: E402
from lmkit.finetune.grpo_data import addition_prompts  # noqa: E402
from lmkit.finetune.rewards import exact_answer  # noqa: E402
from lmkit.train import distributed  # noqa: E402
from lmkit.train.loop import LoopSettings, TrainLoop  # noqa: E402


def make_folder(root: Path, width: int, layers: int, eos_logit: float = 0.0) -> Path:
    import transformers

    rows = addition_prompts(per_digits=50)
    texts = [r["prompt"] + " The answer is " + r["answer"] + "." for r in rows] * 4
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>"])
    eos = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_embd=width, n_layer=layers, n_head=4, n_positions=256, bos_token_id=eos,
        eos_token_id=eos, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if eos_logit:  # the final norm's output gets a constant 4 in coordinate 0, which only EOS's (tied) row reads
        with torch.no_grad():
            model.transformer.ln_f.bias[0] = 4.0
            model.transformer.wte.weight[:, 0] = 0.0
            model.transformer.wte.weight[eos, 0] = eos_logit / 4
    folder = root / "model"
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}), encoding="utf-8")
    return folder


def bench_rows(a) -> list[dict]:
    """The prompts both trainers draw from: the first of the built-in addition-cot task, one epoch's worth."""
    return addition_prompts()[: a.steps * a.batch // a.generations]


def lmkit_steps(folder: Path, a, tmp: Path) -> list[float]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bench_rows(a)), encoding="utf-8")
    config = GRPOConfig(model=str(folder), prompts=str(prompts), reward="exact-answer", out=None,
                        num_generations=a.generations, batch_size=a.batch, max_steps=a.steps,
                        max_completion_length=a.completion, beta=a.beta, lr=1e-6, precision="fp32")
    job = GRPOJob(config, distributed.setup(None))
    job.stop = None  # TRL's rollouts stop at EOS or the length only: the same work on both sides
    times, lengths = [], []
    original = job.train_step

    def timed(step):
        t = time.process_time()
        loss = original(step)
        times.append(time.process_time() - t)
        lengths.append(job.stats["completions/mean_length"])
        return loss

    job.train_step = timed
    loop = TrainLoop(job, LoopSettings(lr=1e-6, max_steps=a.steps, lr_schedule="linear", precision="fp32",
                                       log_every=10**6), out=None)
    loop.fit()
    job.close()
    print(f"lmkit: mean completion length {statistics.mean(lengths):.1f} tokens", flush=True)
    return times


def trl_steps(folder: Path, a, tmp: Path) -> list[float]:
    import datasets
    import transformers
    from trl import GRPOConfig as TRLConfig, GRPOTrainer

    rows = bench_rows(a)
    times, start = [], {}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            start["t"] = time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.process_time() - start["t"])

    args = TRLConfig(output_dir=str(tmp / "trl"), num_generations=a.generations, per_device_train_batch_size=a.batch,
                     max_completion_length=a.completion, beta=a.beta, learning_rate=1e-6, max_steps=a.steps,
                     report_to=[], use_cpu=True, bf16=False, logging_steps=10**6, save_strategy="no",
                     shuffle_dataset=False, top_k=0)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=exact_answer, args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[Timer()])
    trainer.train()
    return times


def arguments(doc: str) -> argparse.ArgumentParser:
    """The bench's settings (profile_grpo.py takes the same)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eos-logit", type=float, default=0.0,
                   help="EOS's logit above the others' at every position (0: a random model, every completion runs "
                        "to the cap; 3: completions of varied lengths, 10-15 tokens on average, as a model that stops)")
    return p


def main() -> None:
    p = arguments(__doc__)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), a.width, a.layers, a.eos_logit)
        results = {"lmkit": lmkit_steps(folder, a, Path(tmp)), "TRL GRPOTrainer": trl_steps(folder, a, Path(tmp))}
    prompts = a.batch // a.generations
    print(f"CPU: {machine.cpu_name()}, {a.threads} thread(s); GPT-2 {a.layers}x{a.width}, G={a.generations}, "
          f"{a.batch} completions per step, {a.completion} tokens each at most, EOS logit +{a.eos_logit}, "
          f"beta {a.beta}, fp32, "
          f"median of steps 2..{a.steps}")
    print("| trainer | s/step (median) | s/step (fastest) | prompts/s (median) |\n| --- | --- | --- | --- |")
    speed, best = {}, {}
    for name, times in results.items():
        median = statistics.median(times[1:] or times)
        speed[name], best[name] = prompts / median, prompts / min(times[1:] or times)
        print(f"| {name} | {median:.3f} | {prompts / best[name]:.3f} | {speed[name]:.2f} |")
    print(f"lmkit / TRL: {speed['lmkit'] / speed['TRL GRPOTrainer']:.2f}x (medians), "
          f"{best['lmkit'] / best['TRL GRPOTrainer']:.2f}x (fastest steps: the least disturbed by other load)")


if __name__ == "__main__":
    main()
