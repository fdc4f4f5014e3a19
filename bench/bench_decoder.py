"""lmkit's decoder vs transformers' GPT-2 on the same weights: training and greedy generation speed.

Model: GPT-2 shape, 4 layers, 4 heads, width 256, context 256, vocabulary 512.
Training: tokens/s of forward + backward + AdamW at batch 16 x 256 tokens, fp32 and bf16 autocast.
Generation: greedy tokens/s (new tokens only) at batch 1 and 8 from a 16-token prompt.
Prints a markdown table with the ratio lmkit / transformers' best.

    python bench/bench_decoder.py [--steps 6] [--new-tokens 128] [--compile]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

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


def train_speed(model, bf16: bool, steps: int, fused: bool, data: torch.Tensor) -> float:
    """Tokens/s of forward + backward + AdamW, after two warm-up steps."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step(ids):
        with autocast(bf16):
            out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(2):
        step(data[i % len(data)])
    start = time.perf_counter()
    for i in range(steps):
        step(data[i % len(data)])
    elapsed = time.perf_counter() - start
    model.eval()
    return steps * data[0].numel() / elapsed


def generate_speed(generate, batch: int, new_tokens: int, repeats: int = 2) -> tuple[float, torch.Tensor]:
    """New tokens/s of greedy decoding (best of `repeats`), and the ids of the last run."""
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, VOCAB, (batch, 16), generator=g)
    generate(prompt, 4)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(prompt, new_tokens)
        best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per setting")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="also time lmkit training under torch.compile")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    hf = hf_model().eval()
    ours = lmkit_from(hf)
    data = torch.randint(0, VOCAB, (3, BATCH, CONTEXT))
    rows = []

    # --- training: each model starts from the same weights for each setting
    state_hf = {k: v.clone() for k, v in hf.state_dict().items()}
    state_ours = {k: v.clone() for k, v in ours.state_dict().items()}
    train = {}
    for bf16 in (False, True):
        hf.load_state_dict(state_hf)
        train[("hf", bf16)] = train_speed(hf, bf16, args.steps, fused=False, data=data)
        ours.load_state_dict(state_ours)
        train[("lmkit", bf16)] = train_speed(ours, bf16, args.steps, fused=True, data=data)
    hf_best = max(train[("hf", False)], train[("hf", True)])
    for bf16 in (False, True):
        name = "bf16 autocast" if bf16 else "fp32"
        rows.append((f"training tokens/s ({name}, batch {BATCH}x{CONTEXT})", train[("hf", bf16)], train[("lmkit", bf16)],
                     train[("lmkit", bf16)] / hf_best))
    if args.compile:
        ours.load_state_dict(state_ours)
        compiled = torch.compile(ours)
        start = time.perf_counter()
        train_speed(compiled, True, 0, fused=True, data=data)
        compile_s = time.perf_counter() - start
        tps = train_speed(compiled, True, args.steps, fused=True, data=data)
        rows.append((f"training tokens/s (bf16, torch.compile; compile {compile_s:.0f} s)", hf_best, tps, tps / hf_best))
    ours.load_state_dict(state_ours)
    hf.load_state_dict(state_hf)

    # --- greedy generation, fp32, same weights: outputs must agree
    for batch in (1, 8):
        hf_tps, hf_ids = generate_speed(
            lambda p, n: hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0), batch, args.new_tokens)
        our_tps, our_ids = generate_speed(lambda p, n: ours.generate(p, max_new_tokens=n, pad_token_id=0), batch,
                                          args.new_tokens)
        same = "same ids" if torch.equal(hf_ids, our_ids) else "ids DIFFER"
        rows.append((f"greedy generation tokens/s (batch {batch}, {args.new_tokens} new, {same})", hf_tps, our_tps,
                     our_tps / hf_tps))

    print(f"\nGPT-2 shape: {LAYERS} layers, {HEADS} heads, width {WIDTH}, context {CONTEXT}, vocabulary {VOCAB}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n")
    print("| measure | transformers | lmkit | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, a, b, r in rows:
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {r:.2f}x |")
    print("\nTraining ratios are against transformers' best setting (fp32 or bf16). "
          "lmkit trains with AdamW(fused=True); transformers with the default AdamW.")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
