"""Peak memory and time of one layer's attention against length: lmkit, PyTorch's SDPA and the naive formula.

softmax(Q K^T / sqrt(d) + causal mask) V for batch 1, 4 heads of size 32 (float32, CPU), forward alone
(no gradients) and forward + backward, at lengths 1k..16k by default (--lengths; 32k takes the tiled path minutes on two cores). The contenders:

- lmkit tiled: `lmkit.nn.kernels.tiled_attention` (FlashAttention's tiling: on CPU ATen's flash kernel per
  block of queries and keys, merged by their log-sum-exp; elsewhere the same in PyTorch ops);
- lmkit C++ (fwd+bwd only): the compiled causal kernel lmkit trains with on CPU in float32
  (`nn/kernels/causal_attention.py`, the softmax recomputed from the log-sum-exp past 4 x head size);
- SDPA: `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`;
- naive: the formula with the n x n scores written out (up to --naive-max tokens: it needs 3-4 of them).

Each (contender, mode, length) runs in a fresh process: the peak is the process's resident high-water mark
(VmHWM, reset through /proc/self/clear_refs once q, k, v and the output gradient exist) less its resident
size at that moment, so it counts what the attention itself allocates; the time is the best of --runs runs
(with one thread, the default, the process's CPU time: the development machine is shared). The exponent is the slope of log(peak) against log(length), fitted over lengths from 4k on
(below that the fixed cost of a process dominates). Writes a Markdown table (stdout and --table) and a plot.
With --model: a whole small model (`model_case`) on a padded row, through lmkit's tiles (the default past
DENSE_MASK_LIMIT) or the dense (B, 1, T, T) mask it builds otherwise, forward and forward + backward.

    python bench/bench_attention_memory.py [--lengths 1024,2048,...] [--threads 1] [--plot docs/img/attention_memory.png]
    python bench/bench_attention_memory.py --short      # the tiles, the default path and SDPA at 256..4096 tokens
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HEADS, HEAD_DIM = 4, 32
CONTENDERS = ("lmkit tiled", "lmkit C++", "SDPA", "naive")
MODEL_CONTENDERS = ("lmkit model, tiles", "lmkit dense mask")


def _status(key: str) -> int:
    """A VmHWM/VmRSS line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def one_case(name: str, mode: str, length: int, runs: int, threads: int) -> dict:
    """{"peak_mb", "seconds"} of one contender in this process."""
    import torch
    import torch.nn.functional as F

    from lmkit.nn.kernels.causal_attention import CausalAttention, library
    from lmkit.nn.kernels.tiled_attention import CPU_TILE, tiled_attention

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=g).requires_grad_(grad) for _ in range(3))
    do = torch.randn(1, HEADS, length, HEAD_DIM, generator=g)
    scale = HEAD_DIM ** -0.5

    def naive(q, k, v):
        n = q.shape[2]
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v

    if name == "lmkit C++" and library() is None:
        raise RuntimeError("the compiled kernel is unavailable here")
    # the tiles themselves: without `tile`, tiled_attention hands this unmasked call to SDPA (see --short)
    fn = {"lmkit tiled": lambda q, k, v: tiled_attention(q, k, v, True, tile=CPU_TILE),
          "lmkit C++": lambda q, k, v: CausalAttention.apply(q, k, v, scale),
          "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "naive": naive}[name]

    def step(q, k, v, do):
        if grad:
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(do)
        else:
            with torch.no_grad():
                fn(q, k, v)

    small = [t[:, :, :300].detach().clone().requires_grad_(grad) for t in (q, k, v)]
    step(*small, do[:, :, :300])  # warm-up (and the C++ kernel's first-use check) before the peak is reset
    best = math.inf
    clock = time.process_time if threads == 1 else time.perf_counter
    rss = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(runs):
        start = clock()
        step(q, k, v, do)
        best = min(best, clock() - start)
    return {"peak_mb": max(_status("VmHWM") - rss, 0) / 2 ** 20, "seconds": best}


def model_case(name: str, mode: str, length: int, runs: int, threads: int) -> dict:
    """{"peak_mb", "seconds"} of a whole small model (LLaMA-like: width 128, 2 layers, 4 heads, 2 key/value
    heads, RoPE) on one row whose first 8 tokens are padding, through lmkit's tiles or its dense mask."""
    import torch

    from lmkit.config import get_preset
    from lmkit.models import build_model

    torch.set_num_threads(threads)
    import lmkit.models.stack
    lmkit.models.stack.DENSE_MASK_LIMIT = 1 << 62 if name == "lmkit dense mask" else 0  # the one or the other
    cfg = get_preset("tiny", vocab_size=512, max_seq_len=length, position="rope", d_model=128, n_layers=2, n_heads=4,
                     n_kv_heads=2, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg).train(mode == "fwd+bwd")

    def step(n):
        ids = torch.randint(0, 512, (1, n))
        mask = torch.ones(1, n, dtype=torch.long)
        mask[:, :8] = 0
        if mode == "fwd+bwd":
            model.zero_grad(set_to_none=True)
            model(ids, attention_mask=mask).logits.float().mean().backward()
        else:
            with torch.no_grad():
                model(ids, attention_mask=mask)

    step(300)
    clock = time.process_time if threads == 1 else time.perf_counter
    rss = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    best = math.inf
    for _ in range(runs):
        start = clock()
        step(length)
        best = min(best, clock() - start)
    return {"peak_mb": max(_status("VmHWM") - rss, 0) / 2 ** 20, "seconds": best}


def short_table(lengths: list[int], threads: int) -> str:
    """Milliseconds (best of 5, CPU time with one thread) at short lengths: the tiles as every call took them
    before (`tile=CPU_TILE`), `tiled_attention`'s default now, and SDPA; causal, and with the first 8 keys padding."""
    import torch
    import torch.nn.functional as F

    from lmkit.nn.kernels.tiled_attention import CPU_TILE, StructuredMask, tiled_attention

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter

    def best(fn, reps=5):
        times = []
        for _ in range(reps):
            start = clock()
            fn()
            times.append(clock() - start)
        return 1e3 * min(times)

    lines = ["| length | causal fwd: tiles | default | SDPA | padded fwd: tiles | default | SDPA + dense mask "
             "| causal fwd+bwd: tiles | default | SDPA |", "| ---: |" + " ---: |" * 9]
    for n in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
        keep = torch.ones(1, n, dtype=torch.bool)
        keep[:, :8] = False
        dense = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=StructuredMask(True, None, keep).dense(1, n, n, q.device))
        with torch.no_grad():
            ms = [best(lambda: tiled_attention(q, k, v, True, tile=CPU_TILE)), best(lambda: tiled_attention(q, k, v, True)),
                  best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                  best(lambda: tiled_attention(q, k, v, True, keep, tile=CPU_TILE)),
                  best(lambda: tiled_attention(q, k, v, True, keep)), best(dense)]
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        ms += [best(lambda: tiled_attention(qg, kg, vg, True, tile=CPU_TILE).sum().backward(), 3),
               best(lambda: tiled_attention(qg, kg, vg, True).sum().backward(), 3),
               best(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward(), 3)]
        lines.append(f"| {n} | " + " | ".join(f"{x:.1f}" for x in ms) + " |")
    return "\n".join(lines)


def exponent(rows: list[dict], name: str, mode: str, start: int = 4096) -> float | None:
    """Least-squares slope of log(peak) against log(length) over lengths >= start."""
    pts = [(math.log(r["length"]), math.log(max(r["peak_mb"], 1e-3))) for r in rows
           if r["name"] == name and r["mode"] == mode and r["length"] >= start and r.get("peak_mb") is not None]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def table(rows: list[dict], lengths: list[int]) -> str:
    head = "| contender | mode | " + " | ".join(f"{n // 1024}k MB / s" for n in lengths) + " | memory exponent |"
    lines = [head, "|" + " --- |" * (len(lengths) + 3)]
    for mode in ("fwd", "fwd+bwd"):
        for name in CONTENDERS + MODEL_CONTENDERS:
            got = {r["length"]: r for r in rows if r["name"] == name and r["mode"] == mode}
            if not got:
                continue
            cells = [f"{got[n]['peak_mb']:.0f} / {got[n]['seconds']:.2f}" if n in got else "-" for n in lengths]
            e = exponent(rows, name, mode)
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + f" | {'-' if e is None else f'{e:.2f}'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, ls in (("fwd", "-"), ("fwd+bwd", "--")):
        for name, color in zip(CONTENDERS, ("C0", "C1", "C2", "C3")):
            got = sorted((r["length"], r["peak_mb"], r["seconds"]) for r in rows if r["name"] == name and r["mode"] == mode)
            if got:
                n, mb, s = zip(*got)
                axes[0].loglog(n, mb, ls, color=color, marker="o", label=f"{name} {mode}")
                axes[1].loglog(n, s, ls, color=color, marker="o", label=f"{name} {mode}")
    for ax, what in zip(axes, ("peak memory (MB)", "time (s)")):
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"one causal attention layer, {HEADS} heads x {HEAD_DIM}, float32 CPU (fwd: solid, fwd+bwd: dashed)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--naive-max", type=int, default=8192)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default="docs/img/attention_memory.png")
    p.add_argument("--table", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--model", action="store_true", help="a whole small model on a padded row instead of one layer")
    p.add_argument("--short", action="store_true",
                   help="time the tiles, the default path and SDPA at 256..4096 tokens in this process")
    p.add_argument("--case", nargs=3, metavar=("NAME", "MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        case = model_case if args.case[0] in MODEL_CONTENDERS else one_case
        print(json.dumps(case(args.case[0], args.case[1], int(args.case[2]), args.runs, args.threads)))
        return
    if args.short:
        print(short_table([256, 512, 1024, 2048, 4096], args.threads))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for name in (MODEL_CONTENDERS if args.model else CONTENDERS):
            if name == "lmkit C++" and mode == "fwd":
                continue  # the model's inference does not run it
            for n in lengths:
                if name == "naive" and n > args.naive_max:
                    continue
                done = subprocess.run([sys.executable, __file__, "--case", name, mode, str(n), "--runs",
                                       str(args.runs), "--threads", str(args.threads)], capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{name} {mode} {n}: failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                    continue
                row = {"name": name, "mode": mode, "length": n, **json.loads(done.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    text = table(rows, lengths)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot and not args.model:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
