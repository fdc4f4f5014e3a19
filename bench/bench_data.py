"""Data at scale: `lmkit data prepare` and `lmkit train --data` on generated corpora of growing size.

A corpus of SIZE bytes is generated (documents of the standard library's source and docstrings, each
with a random suffix so no two are equal) as text files written in a stream; a byte-level BPE
tokenizer is trained once on pydocs. For each size the bench runs, as separate processes:

    lmkit data prepare --corpus DIR --tokenizer tok.json --out SHARDS --workers N
    lmkit train --data SHARDS --preset tiny --max-steps STEPS

and samples the resident memory of the whole process tree (main process + workers) every 0.1 s.
Memory that stays flat while the corpus grows 10x is the claim; tokenizing throughput is reported
next to `tokenizers` (Rust, HF) on the same text and tokenizer as the reference.

    python bench/bench_data.py [--sizes-mb 100 1000] [--workers 2] [--steps 30] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine  # bench/machine.py (the script's folder is on sys.path)


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(resident memory, of it anonymous) of a process and all its descendants, in MB (from /proc).

    The anonymous part is what the processes own; the rest is file-backed (shared libraries, pages of
    the memory-mapped shards), which the kernel drops under memory pressure.
    """
    total, anon, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                    elif line.startswith("RssAnon:"):
                        anon += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / 1024, anon / 1024


def run_measured(cmd: list[str]) -> tuple[float, tuple[float, float], str]:
    """(seconds, (peak RSS, peak anonymous RSS) of the process tree in MB, output tail) of a command."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    peak = (0.0, 0.0)
    out_lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        now = tree_rss_mb(proc.pid)
        peak = (max(peak[0], now[0]), max(peak[1], now[1]))
        time.sleep(0.1)
    reader.join()
    seconds = time.perf_counter() - t0
    tail = "".join(out_lines)[-1500:]
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{tail}")
    return seconds, peak, tail


def generate_corpus(folder: Path, size: int, seed: int = 0) -> int:
    """Text files totalling about `size` bytes, written in a stream (never held in memory)."""
    from lmkit.data import load_corpus

    docs = [d.text for d in load_corpus(["pydocs", "pycode"]).documents]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written, part = 0, 0
    while written < size:
        with open(folder / f"part-{part:04d}.txt", "w", encoding="utf-8") as f:
            chunk = 0
            while chunk < 64 << 20 and written < size:
                text = docs[rng.randrange(len(docs))]
                start = rng.randrange(max(1, len(text) - 2000))
                piece = text[start:start + rng.randint(500, 6000)] + f"\n# variant {rng.getrandbits(48):x}\n\n"
                f.write(piece)
                n = len(piece.encode("utf-8"))
                chunk += n
                written += n
        part += 1
    return written


def reference_throughput(corpus: Path, tokenizer: Path, limit: int = 32 << 20) -> float:
    """MB/s of HF `tokenizers` (Rust, all cores) on the first `limit` bytes: the reference engine."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    texts, n = [], 0
    for path in sorted(corpus.glob("*.txt")):
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            texts.append(para)
            n += len(para.encode("utf-8"))
            if n >= limit:
                break
        if n >= limit:
            break
    t0 = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    return n / (1 << 20) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[100, 1000])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--keep", metavar="DIR", help="work here and keep the files (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="with --keep: skip `prepare` where shards exist")
    args = ap.parse_args()

    import lmkit
    from lmkit.data import load_corpus

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lmkit-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        tok = lmkit.train_tokenizer(load_corpus("pydocs").texts(), kind="bpe", vocab_size=4096,
                                    special_tokens=["<|endoftext|>", "<|pad|>"])
        tok.save(str(tok_path))
    rows = []
    try:
        for mb in args.sizes_mb:
            corpus = work / f"corpus-{mb:g}MB"
            if not corpus.exists():
                generate_corpus(corpus, int(mb * (1 << 20)))
            nbytes = sum(p.stat().st_size for p in corpus.glob("*.txt"))
            shards = work / f"shards-{mb:g}MB"
            lm = [sys.executable, "-m", "lmkit"]
            if args.reuse and (shards / "index.json").exists():
                t_prep, m_prep = float("nan"), (float("nan"), float("nan"))
            else:
                t_prep, m_prep, _ = run_measured(lm + ["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(tok_path),
                                                       "--out", str(shards), "--workers", str(args.workers), "--overwrite"])
            index = json.loads((shards / "index.json").read_text())
            tokens = sum(s["num_tokens"] for s in index["splits"].values())
            run = work / f"run-{mb:g}MB"
            shutil.rmtree(run, ignore_errors=True)
            t_train, m_train, tail = run_measured(lm + ["train", "--data", str(shards), "--out", str(run), "--preset", "tiny",
                                                        "--max-steps", str(args.steps), "--batch-size", "16", "--seq-len", "128",
                                                        "--save-every", str(args.steps), "--precision", "fp32"])
            ref = reference_throughput(corpus, tok_path)
            rows.append(dict(mb=nbytes / (1 << 20), tokens=tokens, dtype=index["dtype"],
                             shard_mb=sum(p.stat().st_size for p in shards.glob("*.safetensors")) / (1 << 20),
                             t_prep=t_prep, rate=nbytes / (1 << 20) / t_prep, ref=ref, m_prep=m_prep,
                             t_train=t_train, m_train=m_train))
            print(f"done {mb:g} MB: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.workers} tokenizing workers, train: tiny preset, {args.steps} steps of 16 x 128 tokens\n")
    print("peak RSS of the process tree (main + workers), and in parentheses its anonymous part\n")
    print(machine.describe(["fp32 (training)"]))
    print("| corpus | tokens | ids | shards | prepare | MB/s | `tokenizers` MB/s (ratio) | prepare peak RSS | train peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mb']:.0f} MB | {r['tokens'] / 1e6:.1f} M | {r['dtype']} | {r['shard_mb']:.0f} MB | {r['t_prep']:.0f} s | "
              f"{r['rate']:.2f} | {r['ref']:.2f} ({r['rate'] / r['ref']:.2f}x) | {r['m_prep'][0]:.0f} ({r['m_prep'][1]:.0f}) MB "
              f"| {r['m_train'][0]:.0f} ({r['m_train'][1]:.0f}) MB |")


if __name__ == "__main__":
    main()
