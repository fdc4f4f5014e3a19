"""Memory and time of Longformer's and BigBird's sparse attention against dense attention, by sequence length.

Models (bare encoders, no head): the `longformer-tiny` preset (width 128, 2 layers, 2 heads, window 64), BigBird at
the same size (blocks of 64, 3 random blocks), a dense RoBERTa of the same size through lmkit's kernels (PyTorch's
SDPA, whose CPU kernel tiles and never stores the n x n matrix in a forward) and the same RoBERTa attending in
matrix products with the probabilities kept ("naive": the formula as written), lengths 512..8192.
Each (model, length) runs in a fresh process, so the peak resident memory it reports is its own:
- forward: the growth of peak RSS over the process's RSS after building the model, for one forward in inference mode;
- training: the bytes of the tensors autograd saves for backward in one forward (what a training step holds),
  counted by a saved-tensors hook: exact, whatever the allocator does;
- time: the best of --runs forwards, in the process's CPU seconds with one thread (a shared machine).
The fitted exponent is the slope of log(memory) and log(time) against log(length) (1: linear, 2: quadratic), over
the lengths from 1024 on.

    python bench/bench_sparse_attention.py [--lengths 512,1024,2048,4096,8192] [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

import machine  # bench/machine.py (the script's folder is on sys.path)

SIZE = dict(vocab_size=4096, d_model=128, n_layers=2, n_heads=2, d_ff=512, dropout=0.0, attention_dropout=0.0)
MODELS = ("longformer", "bigbird", "dense", "naive")
FIT_FROM = 1024  # BigBird falls back to full attention up to (5 + 2 * 3) * 64 = 704 tokens: fit where it is sparse


def build(kind: str, length: int):
    """The bare encoder (no head: a vocabulary-wide head would hide the attention's memory behind its logits)."""
    from lmkit.config import get_preset
    from lmkit.models.encoder import Encoder

    if kind == "longformer":
        cfg = get_preset("longformer-tiny", **SIZE, max_seq_len=length)
    elif kind == "bigbird":
        cfg = get_preset("bert-tiny", **SIZE, max_seq_len=length, family="big_bird",
                         sparse={"sparse_attention": "bigbird", "block_size": 64, "num_random_blocks": 3})
    else:
        cfg = get_preset("roberta", **SIZE, max_seq_len=length)
    model = Encoder(cfg, head=None, pooler=None)
    if kind == "naive":  # softmax(QK^T)V in matrix products, the n x n probabilities kept: the formula as written
        from lmkit.nn.attention import Attention

        for m in model.modules():
            if isinstance(m, Attention):
                m.keep_probabilities = True
    return model


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(kind: str, length: int, runs: int) -> dict:
    """One (model, length) in this process: forward peak RSS growth, saved-for-backward bytes, best forward time."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(kind, length).eval()
    ids = torch.randint(5, 4096, (1, length))
    with torch.inference_mode():
        model(ids[:, :64])  # warm-up at a short length
    base = rss_bytes()
    with torch.inference_mode():
        model(ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    saved = saved_bytes(model, ids)
    best = math.inf
    with torch.inference_mode():
        for _ in range(runs):
            start = time.process_time()
            model(ids)
            best = min(best, time.process_time() - start)
    row = {}
    if kind in ("longformer", "bigbird"):  # a training step through the block tiles and through the batched blocks
        row = {"step_tiles_s": step_seconds(model, ids, runs)}
        with batched_blocks():
            row.update(saved_batched_mb=saved_bytes(model, ids) / 2**20, step_batched_s=step_seconds(model, ids, runs))
    return {"model": kind, "length": length, "forward_peak_mb": max(peak, 0) / 2**20, "saved_mb": saved / 2**20,
            "seconds": best, **row}


def saved_bytes(model, ids) -> int:
    """Bytes of the tensors autograd saves for backward in one training-mode forward."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).last_hidden_state.sum()
    model.eval()
    return saved


def step_seconds(model, ids, runs: int) -> float:
    """Best CPU seconds of a training-mode forward and backward."""
    model.train()
    best = math.inf
    for _ in range(runs):
        start = time.process_time()
        model(ids).last_hidden_state.sum().backward()
        best = min(best, time.process_time() - start)
    model.eval()
    return best


class batched_blocks:
    """Within it, the sparse layers train through their batched blocks instead of the block tiles."""

    def __enter__(self):
        from lmkit.nn import bigbird_attention, sparse_attention

        self.modules = (sparse_attention, bigbird_attention)
        self.saved = [m.use_tiles for m in self.modules]
        for m in self.modules:
            m.use_tiles = lambda dropout: False

    def __exit__(self, *exc):
        for m, f in zip(self.modules, self.saved):
            m.use_tiles = f


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help="which of " + ", ".join(MODELS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "model,length": measure in this process, print JSON
    args = parser.parse_args()
    if args.one:
        kind, length = args.one.split(",")
        print(json.dumps(measure(kind, int(length), args.runs)))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    models = args.models.split(",")
    for kind in models:
        for length in lengths:
            out = subprocess.run([sys.executable, __file__, "--one", f"{kind},{length}", "--runs", str(args.runs)],
                                 check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr)
    print(machine.describe(["fp32"]))
    print("| model | length | forward peak RSS growth (MB) | saved for backward (MB) | forward (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['length']} | {r['forward_peak_mb']:.1f} | {r['saved_mb']:.1f} | {r['seconds']:.3f} |")
    print()
    print("| model | exponent: forward memory | exponent: saved for backward | exponent: time |")
    print("| --- | ---: | ---: | ---: |")
    for kind in models:
        mine = [r for r in rows if r["model"] == kind and r["length"] >= FIT_FROM]
        xs = [r["length"] for r in mine]
        print(f"| {kind} | {slope(xs, [r['forward_peak_mb'] for r in mine]):.2f} | "
              f"{slope(xs, [r['saved_mb'] for r in mine]):.2f} | {slope(xs, [r['seconds'] for r in mine]):.2f} |")
    sparse = [r for r in rows if "step_tiles_s" in r]
    if sparse:
        print()
        print("A training step (forward + backward, dropout 0): saved for backward (MB) and CPU seconds, through the "
              "block tiles (what lmkit trains with) and through the batched blocks (what inference runs):")
        print()
        print("| model | length | saved: tiles | saved: batched | step s: tiles | step s: batched |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in sparse:
            print(f"| {r['model']} | {r['length']} | {r['saved_mb']:.1f} | {r['saved_batched_mb']:.1f} | "
                  f"{r['step_tiles_s']:.3f} | {r['step_batched_s']:.3f} |")
        for kind in sorted({r["model"] for r in sparse}):
            mine = [r for r in sparse if r["model"] == kind and r["length"] >= FIT_FROM]
            xs = [r["length"] for r in mine]
            print(f"\n{kind}: exponent of saved bytes, tiles {slope(xs, [r['saved_mb'] for r in mine]):.2f}, batched "
                  f"{slope(xs, [r['saved_batched_mb'] for r in mine]):.2f}")


if __name__ == "__main__":
    main()
