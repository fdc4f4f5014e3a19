"""Prompt-lookup speculation in `generate` against transformers' (`prompt_lookup_num_tokens`), in one process.

The folder is bench_harness.py's LLaMA (d=256, 4 layers, GQA), random or first trained on the harness tasks'
exemplars (--train-steps). The prompt is three worked sums and a fourth question (addition_cot_d2's shape); both
models continue it greedily, batch 1 (transformers' assisted decoding takes one row), with and without lookup.
A random model repeats itself, which lookup drafts whole; a trained one copies the prompt only now and then.
Prints new tokens per second (fewest CPU seconds of --repeats runs, one thread) and whether the ids are equal.

    python bench/bench_prompt_lookup.py [--new-tokens 64] [--lookup 10] [--train-steps 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402
from bench_harness import build_folder  # noqa: E402


def prompt_text() -> str:
    from lmkit.evaluate.harness_tasks import lmkit_tasks

    shots = "".join(lmkit_tasks.exemplar_texts()[:3])  # the first three worked sums
    return shots + f"Question: {lmkit_tasks.addition(digits=2)['train'][5]['question']}\nAnswer:"


@torch.inference_mode()
def fewest_seconds(fn, repeats: int):
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--train-steps", type=int, default=300, help="steps for the trained folder (0: random only)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers

    import lmkit

    print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}), 1 thread, fp32, "
          f"batch 1, {args.new_tokens} new tokens")
    print(f"{'folder':<8}{'lookup':>7}{'lmkit tok/s':>13}{'transformers tok/s':>20}{'ratio':>8}  same ids")
    with tempfile.TemporaryDirectory() as tmp:
        for name, steps in (("random", 0), ("trained", args.train_steps)):
            if name == "trained" and not steps:
                continue
            folder = build_folder(Path(tmp) / name, steps)
            tok = transformers.AutoTokenizer.from_pretrained(folder)
            ours = lmkit.load_model(folder).eval()
            ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            ids = torch.tensor([tok.encode(prompt_text())])
            for lookup in (None, args.lookup):
                kw = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
                t_ours, a = fewest_seconds(lambda: ours.generate(ids, max_new_tokens=args.new_tokens,
                                                                 eos_token_id=None, **kw), args.repeats)
                t_ref, b = fewest_seconds(lambda: ref.generate(ids, max_new_tokens=args.new_tokens, do_sample=False,
                                                               eos_token_id=None, pad_token_id=0, **kw), args.repeats)
                n = args.new_tokens
                print(f"{name:<8}{lookup or '-':>7}{n / t_ours:>13.0f}{n / t_ref:>20.0f}{t_ref / t_ours:>7.2f}x  "
                      f"{torch.equal(a, b)}")


if __name__ == "__main__":
    main()
