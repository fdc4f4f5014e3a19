"""Greedy decoding of a small Mistral-like model with a sliding window: DecodePlan vs the modules vs transformers.

Model: width 256, 4 layers, 8 heads, 2 key/value heads, SwiGLU, vocabulary 512, window 32. Batch 1, a
16-token prompt and 256 new tokens, so most steps run past the window. Reports new tokens/s of lmkit with
DecodePlan (the fast path), lmkit through its modules (the slow path), and transformers'
MistralForCausalLM on the same weights, which all choose the same ids. The three take turns and the
best run of each counts; with one thread the clock is the process's CPU time (a shared machine).

    python bench/bench_sliding_window.py [--new-tokens 256] [--runs 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from unittest import mock

import torch

import machine  # bench/machine.py (the script's folder is on sys.path)

WIDTH, LAYERS, HEADS, KV_HEADS, VOCAB, WINDOW = 256, 4, 8, 2, 512, 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter

    import transformers
    from transformers import MistralConfig, MistralForCausalLM

    import lmkit
    from lmkit.generation.decode_plan import DecodePlan

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=688,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          num_key_value_heads=KV_HEADS, sliding_window=WINDOW,
                                          max_position_embeddings=1024)).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = lmkit.load_model(folder)
    prompt = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens

    def fast():
        return ours.generate(prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

    def slow():
        with mock.patch.object(DecodePlan, "build", classmethod(lambda cls, model, batch: None)):
            return ours.generate(prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

    def reference():
        with torch.inference_mode():
            return hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    runs = {"lmkit, DecodePlan": fast, "lmkit, modules": slow, "transformers": reference}
    best = {name: float("inf") for name in runs}
    outputs = {}
    for _ in range(args.runs):
        for name, run in runs.items():
            start = clock()
            outputs[name] = run()
            best[name] = min(best[name], clock() - start)
    same = all(torch.equal(out, outputs["transformers"]) for out in outputs.values())
    print(f"batch 1, prompt 16, {n} new tokens, window {WINDOW}, {args.threads} thread(s); same ids: {same}")
    print(machine.describe(["fp32"]))
    print("| path | new tokens/s | vs modules |")
    print("| --- | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {n / seconds:.0f} | {best['lmkit, modules'] / seconds:.2f}x |")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
