"""Shared setup of the PEFT and compression benchmarks: a small base model trained on `pydocs`
by `lmkit train` (cached under $LMKIT_BENCH_DIR, default /tmp/lmkit-bench), and data of a corpus
tokenized with the base model's tokenizer. Scripts print markdown tables.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import lmkit

# one thread per process: small models on a shared CPU run several times faster than with OpenMP teams
torch.set_num_threads(int(os.environ.get("LMKIT_BENCH_THREADS", "1")))
BENCH_DIR = Path(os.environ.get("LMKIT_BENCH_DIR", "/tmp/lmkit-bench"))
SEQ_LEN = 128


BASE = {"n_kv_heads": None, "d_model": 128, "n_heads": 8}  # the default preset, narrower, with full multi-head attention


def base_model(steps: int = int(os.environ.get("LMKIT_BENCH_BASE_STEPS", "250")), preset: str = "default") -> Path:
    """Folder of the base model: 4 layers x 8 heads, d = 128, vocabulary 4096, trained on pydocs."""
    out = BENCH_DIR / f"base-{preset}-d128-{steps}"
    if (out / "model.safetensors").exists():
        return out
    from lmkit.train import TrainConfig, Trainer

    cfg = TrainConfig(preset=preset, corpus=["pydocs"], out=str(out), max_steps=steps, batch_size=16, seq_len=SEQ_LEN,
                      precision="fp32", progress=False, model_overrides=BASE, lr=3e-3, warmup_steps=30, seed=0)
    t = time.perf_counter()
    Trainer(cfg).fit()
    print(f"trained the base model ({steps} steps) in {time.perf_counter() - t:.0f} s -> {out}")
    return out


def data(folder: Path, corpus: str, seq_len: int = SEQ_LEN, max_val_docs: int | None = 60):
    """Train stream and validation rows of `corpus` under the base model's tokenizer (see CausalLMData)."""
    from lmkit.finetune.clm import CausalLMData

    return CausalLMData(lmkit.load_tokenizer(folder / "tokenizer.json"), [corpus], seq_len, max_val_docs)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown table of rows, columns given as (key, header)."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k, _ in columns) + " |")
    return "\n".join(lines)
