"""lmkit's decoder vs transformers' GPT-2 on the same weights: training and greedy generation speed.

Model: GPT-2 shape, 4 layers, 4 heads, width 256, context 256, vocabulary 512.
Training: tokens/s of forward + backward + AdamW at batch 16 x 256 tokens, fp32 and bf16 autocast.
Generation: greedy tokens/s (new tokens only) at batch 1 and 8 from a 16-token prompt.
Prints a markdown table with the ratio lmkit / transformers' best. The two models take turns
(one training step or one generation run each) and the best time of each counts, so that both see
the same load on a shared machine; with one thread the clock is the process's CPU time, so that
waiting for a core shared with other jobs does not count.

    python bench/bench_decoder.py [--steps 6] [--new-tokens 128] [--threads 1] [--compile]

Both models use the same optimizer (torch.optim.AdamW, fused=True, which is also the default of
transformers' Trainer) and the same thread count.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402

WIDTH, LAYERS, HEADS, CONTEXT, VOCAB, BATCH = 256, 4, 4, 256, 512, 16


def hf_model():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=CONTEXT,
                     bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def lmkit_from(hf) -> torch.nn.Module:
    import lmkit

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return lmkit.load_model(d)


def autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


class Trainer:
    """One model's forward + backward + AdamW step at a given precision."""

    def __init__(self, model, bf16: bool, data: torch.Tensor):
        self.model, self.bf16, self.data, self.i = model.train(), bf16, data, 0
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(self) -> None:
        ids = self.data[self.i % len(self.data)]
        self.i += 1
        with autocast(self.bf16):
            out = self.model(ids, labels=ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


CLOCK = time.perf_counter


def interleaved(runs: dict, rounds: int) -> dict:
    """Best time of each callable over `rounds`, taking turns so that both see the same machine load."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = CLOCK()
            fn()
            best[name] = min(best[name], CLOCK() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20,
                    help="timed training steps per model and setting (best counts; more steps ride out a noisy machine)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed generation runs per model (best counts)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both (default 1: on a shared machine more threads spin against other jobs)")
    ap.add_argument("--compile", action="store_true", help="also time lmkit training under torch.compile")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="cpu: process CPU time (default with one thread: robust to other jobs on a shared "
                         "machine); wall: elapsed time (default with more threads)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    global CLOCK
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    hf = hf_model().eval()
    ours = lmkit_from(hf)
    data = torch.randint(0, VOCAB, (3, BATCH, CONTEXT))
    rows = []

    # --- training: each model starts from the same weights for each setting; steps alternate
    state_hf = {k: v.clone() for k, v in hf.state_dict().items()}
    state_ours = {k: v.clone() for k, v in ours.state_dict().items()}
    train = {}
    settings = [False, True] if machine.run_bf16() else [False]
    for bf16 in settings:
        hf.load_state_dict(state_hf)
        ours.load_state_dict(state_ours)
        trainers = {"hf": Trainer(hf, bf16, data), "lmkit": Trainer(ours, bf16, data)}
        interleaved({k: t.step for k, t in trainers.items()}, 2)  # warm-up
        best = interleaved({k: t.step for k, t in trainers.items()}, args.steps)
        for name, seconds in best.items():
            train[(name, bf16)] = data[0].numel() / seconds
    hf_best = max(train[("hf", bf16)] for bf16 in settings)
    for bf16 in settings:
        name = "bf16 autocast" if bf16 else "fp32"
        rows.append((f"training tokens/s ({name}, batch {BATCH}x{CONTEXT})", train[("hf", bf16)], train[("lmkit", bf16)],
                     train[("lmkit", bf16)] / hf_best))
    if args.compile:
        ours.load_state_dict(state_ours)
        trainer = Trainer(torch.compile(ours), machine.run_bf16(), data)
        start = time.perf_counter()
        trainer.step()
        compile_s = time.perf_counter() - start
        tps = data[0].numel() / interleaved({"lmkit": trainer.step}, args.steps)["lmkit"]
        kind = "bf16" if machine.run_bf16() else "fp32"
        rows.append((f"training tokens/s ({kind}, torch.compile; compile {compile_s:.0f} s)", hf_best, tps, tps / hf_best))
    ours.load_state_dict(state_ours)
    hf.load_state_dict(state_hf)
    hf.eval()
    ours.eval()

    # --- greedy generation, fp32, same weights, alternating runs: outputs must agree
    n = args.new_tokens
    for batch in (1, 8):
        prompt = torch.randint(0, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(batch))
        outputs = {}

        def run_hf():
            outputs["hf"] = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=0)

        def run_ours():
            outputs["lmkit"] = ours.generate(prompt, max_new_tokens=n, pad_token_id=0)

        interleaved({"hf": run_hf, "lmkit": run_ours}, 1)  # warm-up
        best = interleaved({"hf": run_hf, "lmkit": run_ours}, args.repeats)
        same = "same ids" if torch.equal(outputs["hf"], outputs["lmkit"]) else "ids DIFFER"
        hf_tps, our_tps = batch * n / best["hf"], batch * n / best["lmkit"]
        rows.append((f"greedy generation tokens/s (batch {batch}, {n} new, {same})", hf_tps, our_tps, our_tps / hf_tps))

    print(f"\nGPT-2 shape: {LAYERS} layers, {HEADS} heads, width {WIDTH}, context {CONTEXT}, vocabulary {VOCAB}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{'process CPU' if clock == 'cpu' else 'wall-clock'} time, load average {os.getloadavg()[0]:.1f}")
    print(machine.describe(["fp32", "bf16 autocast"] if machine.run_bf16() else ["fp32"]))
    if not machine.run_bf16():
        print(machine.skipped_line("bf16 autocast training rows"))
    print()
    print("| measure | transformers | lmkit | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, a, b, r in rows:
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {r:.2f}x |")
    print(f"\nTraining ratios are against transformers' best setting ({' or '.join('bf16' if b else 'fp32' for b in settings)}); "
          "both use AdamW(fused=True).")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
