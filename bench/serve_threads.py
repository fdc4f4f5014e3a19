"""Why `lmkit serve --engine-thread` (the engine in a thread of the HTTP process) is slower than the engine in a child
process (the default), issue 38: the issue's model (bench_serve's `--shape issue`, fp32), streaming greedy
completions of --max-tokens tokens from --clients clients, one server at a time with --threads torch threads, the
thread mode under settings that each take one suspect away, beside the default, in one run:

    process         the default: the engine in a child process
    process 5ms     the same with Python's own switch interval in the HTTP process
    process passive the engine process with OMP_WAIT_POLICY=PASSIVE (OpenMP's workers sleep at once)
    process spin 10k  the engine process with GOMP_SPINCOUNT=10000 (they spin a little, then sleep)
    thread          --engine-thread as shipped (sys.setswitchinterval(0.0002) in the CLI)
    thread 5ms      the same with Python's own switch interval (5 ms): the CLI's call made a no-op
    thread passive  OMP_WAIT_POLICY=PASSIVE: OpenMP's worker threads sleep after a parallel region instead of spinning
    thread 1 omp    OMP_NUM_THREADS=1: no OpenMP worker at all (one core's compute)

Per row: output tokens/s, p50/p99 inter-token latency, and the server's CPU ms per output token over its process
tree. One untimed pass, then --repeat timed ones (the median pass).

    python bench/serve_threads.py [--clients 1] [--max-tokens 64] [--threads 2] [--repeat 1]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402
import bench_vllm  # noqa: E402
import machine  # noqa: E402

NO_SWITCH = [sys.executable, "-c", "import sys; sys.setswitchinterval = lambda s: None; from lmkit.cli import main; "
             "sys.exit(main())"]
SETTINGS = {  # name -> (lmkit serve flags, environment, launcher)
    "process": ([], {}, None),
    "process 5ms": ([], {}, NO_SWITCH),
    "process passive": ([], {"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "process spin 10k": ([], {"GOMP_SPINCOUNT": "10000"}, None),
    "thread": (["--engine-thread"], {}, None),
    "thread 5ms": (["--engine-thread"], {}, NO_SWITCH),
    "thread passive": (["--engine-thread"], {"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "thread 1 omp": (["--engine-thread"], {"OMP_NUM_THREADS": "1"}, None),
}


def direct(folder: Path, prompt: list[int], max_tokens: int, repeat: int) -> None:
    """No HTTP: the issue's model loaded in the main thread, one request of `max_tokens` greedy tokens through an
    `Engine`, stepped in the main thread (one OpenMP team in the process, as in the engine process) and then in a
    second thread (a second team, as in --engine-thread: libgomp counts more OpenMP threads than CPUs and throttles
    its spin-waiting). Wall and process CPU per token, the best of `repeat` runs each."""
    import threading
    import time

    import lmkit
    from lmkit.generation import GenerationConfig
    from lmkit.generation.engine import Engine, Request

    model = lmkit.load_model(folder)
    engine = Engine(model, max_batch=4)

    def run() -> tuple[float, float]:
        best = (float("inf"), float("inf"))
        for _ in range(repeat + 1):
            request = Request(prompt=prompt, config=GenerationConfig(max_new_tokens=max_tokens, do_sample=False))
            start, cpu = time.perf_counter(), time.process_time()
            engine.run_all([request])
            best = min(best, ((time.perf_counter() - start) / max_tokens, (time.process_time() - cpu) / max_tokens))
        return best

    for where in ("main thread", "second thread"):
        if where == "main thread":
            wall, cpu = run()
        else:
            box = []
            thread = threading.Thread(target=lambda: box.append(run()))
            thread.start(), thread.join()
            wall, cpu = box[0]
        print(f"engine alone in the {where:>13}: {1 / wall:>6.1f} tok/s, {cpu * 1e3:.2f} ms CPU per token "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="*", default=[1])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME")
    parser.add_argument("--direct", action="store_true", help="instead: the engine alone, main thread or a second")
    args = parser.parse_args()
    if args.direct:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before torch loads (it reads it once)
    import lmkit
    from lmkit.data import load_corpus

    docs = [d.text for d in load_corpus("pydocs") if len(d.text) > 1200]
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_serve.make_folder(Path(tmp) / "model", "issue")
        tok = lmkit.load_tokenizer(folder)
        if args.direct:
            direct(folder, tok.encode(docs[0])[:150], args.max_tokens, args.repeat)
            return
        print(f"CPU: {machine.cpu_name()}, {os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f}; "
              f"{args.threads} threads per server; fp32; {args.max_tokens} new tokens, greedy, streamed")
        print(f"{'clients':>7} {'setting':>15} {'tok/s':>8} {'ITL p50':>8} {'ITL p99':>8} {'CPU ms/tok':>10} {'load':>5}")
        for n in args.clients:
            prompts = [bench_serve.readable(folder, [
                f"({k}-{i}) " + tok.decode(tok.encode(docs[i % len(docs)])[:100 + (i * 37) % 101])
                for i in range(3 * n)], n) for k in range(args.repeat + 1)]
            for name in args.settings:
                flags, env, launcher = SETTINGS[name]
                process, url = bench_serve.start("lmkit", folder, args.threads, max(n, 16), 256,
                                                 extra=["--quiet", "--dtype", "fp32", *flags], env=env,
                                                 launcher=launcher)
                try:
                    r = bench_vllm.measure(process, url, prompts, args.max_tokens, args.repeat)
                finally:
                    bench_vllm.stop(process)
                print(f"{n:>7} {name:>15} {r['tok_s']:>8.1f} {r['itl_p50'] * 1e3:>6.1f}ms {r['itl_p99'] * 1e3:>6.1f}ms "
                      f"{r['server_cpu'] / max(r['tokens'], 1) * 1e3:>10.2f} {os.getloadavg()[0]:>5.1f}", flush=True)


if __name__ == "__main__":
    main()
