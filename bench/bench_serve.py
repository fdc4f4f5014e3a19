"""Serving throughput and latency: `lmkit serve` (continuous batching) against (a) the same streaming HTTP handler
calling transformers' generate one request at a time, and (b) lmkit's static batched generate at that batch size.

For 1, 4, 16 and 64 concurrent streaming clients on loopback (one request each, greedy, the same prompts and
max_tokens for every side): output tokens/s, p50/p99 time to first token and inter-token latency, the ratios against
(a) and (b), the CPU, and the server's peak RSS over the run. Servers run in their own processes with --threads torch
threads. Every side runs the workload once untimed first (a long-running server is warm: oneDNN's kernels for the
shapes seen, the allocator's pools), then --repeat timed times; the figures are the median pass's. The CPU seconds
the client process and the server process spent per timed pass are printed, so that a client too slow to keep
up, or a server starved of CPU by other work on the machine, shows.

    python bench/bench_serve.py [--clients 1 4 16 64] [--max-tokens 32] [--threads 1] [--repeat 3]
    python bench/bench_serve.py --soak 600     # faults and memory over time: see serve_soak.py
    python bench/bench_serve.py --workload chat|rag   # prefix caching on and off: see serve_workloads.py
    python bench/bench_serve.py --budgets 64 256 1024 --clients 1 16   # the step's token budget
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))




def make_folder(path: Path, shape: str = "small", positions: int = 1024) -> Path:
    """A random model with a byte-level BPE tokenizer of the stdlib docs: GPT-2-shaped (d 256, 4 layers, 8 heads), or
    with `shape` "issue" the LLaMA body issue 38 raced vLLM with (hidden 512, 8 layers, 8 heads, 4 KV heads) on this
    tokenizer's vocabulary, with `positions` positions."""
    import torch
    import transformers

    import lmkit
    from lmkit.data import load_corpus

    texts = [d.text for d in load_corpus("pydocs")][:300]
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=4000, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    # no EOS id: every side generates exactly --max-tokens tokens per request
    if shape == "issue":
        cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=512, intermediate_size=1536,
                                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=positions, bos_token_id=None, eos_token_id=None)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    else:
        cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_embd=256, n_layer=4, n_head=8, n_positions=512,
                                      bos_token_id=None, eos_token_id=None)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


# ---- (a): the quick FastAPI wrapper: one transformers generate at a time, streamed through a TextIteratorStreamer
def baseline_app(folder: str):
    import torch
    import transformers
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True)
        ids = torch.tensor([tok.encode(body["prompt"])])

        def work():
            with lock, torch.inference_mode():
                model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False, streamer=streamer,
                               pad_token_id=0)

        threading.Thread(target=work, daemon=True).start()

        async def events():
            count = 0
            iterator = iter(streamer)
            while True:
                text = await asyncio.to_thread(next, iterator, None)
                if text is None:
                    break
                count += 1
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': None}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': body['max_tokens']}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def readable(folder: Path, texts: list[str], count: int) -> list[str]:
    """The first `count` of `texts` whose greedy first token decodes to whole characters. A random model's greedy
    reply can open with a run of lone UTF-8 bytes (one byte-level token repeated) that never completes a character:
    a server holds such text back (lmkit and vLLM both do), so that request's first text, and with it the p99 time to
    first token of a pass, would come only when the run ends (82 tokens into one reply of 64 in issue 38's race)."""
    import torch

    import lmkit

    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    out = []
    with torch.inference_mode():
        for text in texts:
            first = int(model(torch.tensor([tok.encode(text)])).logits[0, -1].argmax())
            piece = tok.decode([first])
            if piece and "\ufffd" not in piece:
                out.append(text)
                if len(out) == count:
                    return out
    raise RuntimeError(f"only {len(out)} of {len(texts)} prompts open with readable text; give more")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, folder: Path, threads: int, max_concurrency: int, prefill_chunk: int,
          max_queue: int = 1024, extra: list[str] | None = None, env: dict | None = None,
          launcher: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """A server in its own process, ready: `lmkit serve` (kind "lmkit", with `extra` flags; `launcher`: the command
    before `serve`, default python -m lmkit) or the baseline; `env`: variables set beside the bench's own."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src"),
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if kind == "lmkit":
        cmd = [*(launcher or [sys.executable, "-m", "lmkit"]), "serve", "--model", str(folder), "--port", str(port),
               "--max-concurrency", str(max_concurrency), "--max-queue", str(max_queue), "--prefill-chunk", str(prefill_chunk),
               *(extra or [])]
    else:
        cmd = [sys.executable, __file__, "--baseline-server", str(folder), "--port", str(port)]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, 120, lambda: process.stderr.read().decode()[-2000:])
    return process, url


def wait_healthy(process, url: str, seconds: float, log: Callable[[], str], poll: float = 0.1) -> None:
    """Return once `url`/health answers 200; raise with the server's `log()` if it exits or `seconds` pass."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited:\n" + log())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    process.kill()
    raise RuntimeError(f"the server did not start in {seconds:.0f} s:\n" + log())


def rss_mb(pid: int, field: str = "VmHWM") -> float:
    """A memory figure of /proc/PID/status in MB: VmHWM (peak resident set) or VmRSS (resident now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process `pid` has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_client(client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: its time to first token, the gaps between tokens, its text and its usage
    (completion tokens, prompt tokens, and of those the ones the prefix cache served)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, text, usage = [], [], {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        headers = time.perf_counter()  # the server has taken the request (a stream's headers come at submission)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
    return {"ttft": stamps[0] - start if stamps else float("nan"), "taken": headers - start, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "text": "".join(text), "tokens": usage.get("completion_tokens", 0), "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def drive(url: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        start, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one_client(client, url, p, max_tokens) for p in prompts))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    gaps = sorted(g for r in results for g in r["gaps"])
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    taken = sorted(r["taken"] for r in results)
    return {"tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts), "ttft_p99": pct(ttfts, 0.99),
            "taken_p99": pct(taken, 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99), "tokens": tokens, "wall": wall,
            "client_cpu": cpu}


def timed_passes(url: str, pid: int, prompts: list[str], max_tokens: int, repeat: int,
                 fresh: list[list[str]] | None = None) -> dict:
    """One untimed pass of the workload, then `repeat` timed ones: the median pass by tokens/s, with the server's
    CPU seconds over that pass. `fresh`: the prompts of each pass (repeat + 1 lists), where no pass may reuse an
    earlier one's from the prefix cache (default: `prompts` every pass)."""
    fresh = fresh or [prompts] * (repeat + 1)
    asyncio.run(drive(url, fresh[0], max_tokens))
    passes = []
    for k in range(repeat):
        before = cpu_seconds(pid)
        result = asyncio.run(drive(url, fresh[k + 1], max_tokens))
        result["server_cpu"] = cpu_seconds(pid) - before
        passes.append(result)
    return sorted(passes, key=lambda r: r["tok_s"])[len(passes) // 2]


def static_batched(folder: Path, prompts: list[str], max_tokens: int, threads: int, repeat: int) -> tuple[float, float]:
    """(b): lmkit's generate on all prompts as one left-padded batch: (output tokens/s, CPU seconds) of the median
    of `repeat` timed runs after one untimed run."""
    import torch

    import lmkit

    torch.set_num_threads(threads)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    rows = [tok.encode(p) for p in prompts]
    width = max(map(len, rows))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    runs = []
    for run in range(repeat + 1):
        start, cpu = time.perf_counter(), time.process_time()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        if run:
            runs.append(((out.shape[0] * (out.shape[1] - width)) / (time.perf_counter() - start),
                         time.process_time() - cpu))
    return sorted(runs)[len(runs) // 2]


def server_ttft(url: str) -> tuple[float, float]:
    """(seconds, requests) of the server's own time-to-first-token histogram so far: from a request's submission to
    the engine to its first token, without the HTTP and client time around it."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("lmkit_time_to_first_token_seconds_sum", "lmkit_time_to_first_token_seconds_count")):
            name, value = line.split()
            values[name.rsplit("_", 1)[1]] = float(value)
    return values.get("sum", 0.0), values.get("count", 0.0)


def budgets(args, folder: Path, tok, docs: list[str]) -> None:
    """lmkit serve alone at each token budget a step (--prefill-chunk), the plain workload's prompts (new ones each
    pass, so that the prefix cache serves none of them), all clients at once; the server's own mean time to first
    token beside the clients' TTFT, and `taken`: from a client's start to its stream's headers (the server has parsed
    and submitted the request)."""
    print(f"{'clients':>7} {'budget':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'server TTFT mean':>16} {'taken p99':>9}")
    for n in args.clients:
        passes = [readable(folder, [f"({k}) " + docs[i % len(docs)][:200 + 7 * (i % n)] for i in range(3 * n)], n)
                  for k in range(args.repeat + 1)]
        lengths = [len(tok.encode(p)) for p in passes[0]]
        print(f"{n:>7} prompts of {min(lengths)} to {max(lengths)} tokens, {args.max_tokens} new tokens each, "
              f"--max-concurrency {args.max_concurrency or max(16, n)} {' '.join(args.serve_flags)}")
        for budget in args.budgets:
            process, url = start("lmkit", folder, args.threads, args.max_concurrency or max(16, n), budget,
                                 extra=args.serve_flags)
            try:
                asyncio.run(drive(url, passes[0], args.max_tokens))
                rows, before = [], server_ttft(url)
                for prompts in passes[1:]:
                    rows.append(asyncio.run(drive(url, prompts, args.max_tokens)))
                after = server_ttft(url)
            finally:
                process.terminate()
                process.wait(timeout=30)
            r = sorted(rows, key=lambda r: r["tok_s"])[len(rows) // 2]
            mean = (after[0] - before[0]) / max(after[1] - before[1], 1)
            print(f"{n:>7} {budget:>7} {r['tok_s']:>8.1f} {r['ttft_p50'] * 1e3:>7.1f}ms {r['ttft_p99'] * 1e3:>7.1f}ms "
                  f"{r['itl_p50'] * 1e3:>6.1f}ms {r['itl_p99'] * 1e3:>6.1f}ms {mean * 1e3:>14.1f}ms "
                  f"{r['taken_p99'] * 1e3:>7.1f}ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="lmkit serve's --prefill-chunk")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per side (the median is reported)")
    parser.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                        help="instead: a soak of this many seconds (serve_soak.py): random requests, disconnects and "
                             "bad input against lmkit serve, its RSS sampled over time")
    parser.add_argument("--workload", choices=["plain", "chat", "rag"], default="plain",
                        help="plain: the comparison above; chat, rag: prompts sharing prefixes, lmkit serve with its "
                             "prefix cache against itself without it (serve_workloads.py)")
    parser.add_argument("--shape", choices=["small", "issue"], default="small",
                        help="the random model: small (GPT-2, d 256, 4 layers) or issue 38's LLaMA body (hidden 512, "
                             "8 layers, 8 heads, 4 KV heads)")
    parser.add_argument("--turns", type=int, default=3, help="turns of each --workload chat conversation")
    parser.add_argument("--budgets", type=int, nargs="*", default=None, metavar="N",
                        help="instead: lmkit serve alone at each of these --prefill-chunk token budgets (the plain "
                             "workload), to choose the budget")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="--budgets: lmkit serve's --max-concurrency (default: the clients, at least 16)")
    parser.add_argument("--serve-flags", nargs="*", default=[], metavar="FLAG",
                        help="--budgets: more lmkit serve flags, e.g. --serve-flags=--engine-thread")
    parser.add_argument("--baseline-server", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        import torch
        import uvicorn

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        uvicorn.run(baseline_app(args.baseline_server), host="127.0.0.1", port=args.port, log_level="warning")
        return
    from lmkit.data import load_corpus

    docs = [d.text for d in load_corpus("pydocs") if len(d.text) > 400]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "model", args.shape)
        print(f"CPU: {machine.cpu_name()} (bf16 {'native' if machine.bf16_native() else 'emulated'}), "
              f"{os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f}; {args.threads} torch thread(s) "
              f"per server")
        if args.soak is not None:
            import serve_soak

            process, url = start("lmkit", folder, args.threads, 16, 256, max_queue=8)
            try:
                serve_soak.report(asyncio.run(serve_soak.soak(url, process.pid, docs, args.soak)))
            finally:
                process.terminate()
                process.wait(timeout=30)
            return
        if args.workload != "plain":
            import serve_workloads

            serve_workloads.run(args, folder, docs, start, rss_mb, one_client)
            return
        import lmkit

        tok = lmkit.load_tokenizer(folder)
        if args.budgets:
            budgets(args, folder, tok, docs)
            return
        print(f"{'clients':>7} {'side':>10} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
              f" {'wall':>6} {'client CPU':>10} {'server CPU':>10}")
        for n in args.clients:
            prompts = [docs[i % len(docs)][:200 + 7 * i] for i in range(n)]  # mixed lengths
            lengths = [len(tok.encode(p)) for p in prompts]
            print(f"{n:>7} prompts of {min(lengths)} to {max(lengths)} tokens, {args.max_tokens} new tokens each")
            rows = {}
            for kind in ("lmkit", "baseline"):
                process, url = start(kind, folder, args.threads, max(16, n), args.prefill_chunk)
                try:
                    rows[kind] = timed_passes(url, process.pid, prompts, args.max_tokens, args.repeat)
                    rows[kind]["rss"] = rss_mb(process.pid)
                finally:
                    process.terminate()
                    process.wait(timeout=30)
            batched, batched_cpu = static_batched(folder, prompts, args.max_tokens, args.threads, args.repeat)
            for kind, r in rows.items():
                print(f"{n:>7} {kind:>10} {r['tok_s']:>8.1f} {r['ttft_p50'] * 1e3:>7.1f}ms {r['ttft_p99'] * 1e3:>7.1f}ms "
                      f"{r['itl_p50'] * 1e3:>6.1f}ms {r['itl_p99'] * 1e3:>6.1f}ms {r['wall']:>5.2f}s "
                      f"{r['client_cpu']:>9.2f}s {r['server_cpu']:>9.2f}s   peak RSS {r['rss']:.0f} MB")
            print(f"{n:>7} {'static':>10} {batched:>8.1f} {'':>39} {n * args.max_tokens / batched:>5.2f}s {'':>10} "
                  f"{batched_cpu:>9.2f}s")
            per_token = {kind: r["server_cpu"] / r["tokens"] * 1e3 for kind, r in rows.items()}
            print(f"{n:>7} server CPU ms per output token: lmkit {per_token['lmkit']:.2f}, (a) {per_token['baseline']:.2f}, "
                  f"(b) {batched_cpu / (n * args.max_tokens) * 1e3:.2f}")
            print(f"{n:>7} ratios: lmkit / (a) transformers one at a time = "
                  f"{rows['lmkit']['tok_s'] / rows['baseline']['tok_s']:.2f}x, "
                  f"lmkit / (b) static batched generate = {rows['lmkit']['tok_s'] / batched:.2f}", flush=True)


if __name__ == "__main__":
    main()
