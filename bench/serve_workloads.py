"""Workloads that share prompt prefixes, for `bench_serve.py --workload chat|rag`: lmkit serve with its prefix
cache against itself without it (--cache-memory 0), same clients, same prompts.

chat: every client holds a conversation of --turns turns that resends its history (the previous prompt, the reply,
a new user line), after one long system prompt that every conversation shares. rag: every request is an
instruction, three retrieved passages and a question; requests about one of four topics get the same passages in
the same order. prefix (bench_vllm.py --workload prefix): one long system text every request shares and a short
question. A pass number inside each conversation (after the system prompt) and inside each question keeps a
pass from reusing an earlier pass's conversations, while the system prompt and the passages stay cached across
passes as they would on a long-running server.
"""
from __future__ import annotations

import asyncio
import statistics
import time


async def _conversation(request, client, url: str, first: str, turns: int, max_tokens: int, tag: str) -> list[dict]:
    prompt, out = first, []
    for turn in range(turns):
        result = await request(client, url, prompt, max_tokens)
        out.append(result)
        prompt = f"{prompt}{result['text']}\nUser: and then ({tag}, turn {turn + 2})?\nAssistant:"
    return out


def prompts_for(workload: str, docs: list[str], clients: int, pass_no: int, system: str | None = None) -> list[str]:
    """The first prompt of each client's session (chat) or each client's request (rag; prefix: one long shared
    `system` text and a short question)."""
    if workload == "prefix":
        return [f"{system}\nQuestion ({pass_no}-{i}): {docs[20 + i % 5][:80]}\nAnswer:" for i in range(clients)]
    if workload == "chat":
        system = "System: you answer questions about Python's standard library.\n" + docs[0][:900]
        return [f"{system}\nUser: (session {pass_no}-{i}) {docs[1 + i % 7][:120]}\nAssistant:" for i in range(clients)]
    passages = [d[:420] for d in docs[10:18]]
    return ["Answer from the sources.\n" + "\n".join(passages[2 * (i % 4):2 * (i % 4) + 3])
            + f"\nQuestion ({pass_no}-{i}): {docs[20 + i % 5][:80]}\nAnswer:" for i in range(clients)]


async def drive(request, url: str, workload: str, docs: list[str], clients: int, turns: int, max_tokens: int,
                pass_no: int, system: str | None = None) -> dict:
    """One pass: every client's session (chat) or request (rag, prefix) at once, each request through `request`
    (bench_serve.one_client)."""
    import httpx

    firsts = prompts_for(workload, docs, clients, pass_no, system)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()
        if workload == "chat":
            sessions = await asyncio.gather(*(_conversation(request, client, url, p, turns, max_tokens, f"{pass_no}-{i}")
                                              for i, p in enumerate(firsts)))
            results = [r for s in sessions for r in s]
        else:
            results = await asyncio.gather(*(request(client, url, p, max_tokens) for p in firsts))
        wall = time.perf_counter() - start
    gaps = sorted(g for r in results for g in r["gaps"])
    ttfts = sorted(r["ttft"] for r in results)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    prompt = sum(r["prompt"] for r in results)
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": pct(ttfts, 0.99), "itl_p99": pct(gaps, 0.99), "wall": wall, "requests": len(results),
            "prompt_tokens": prompt, "hit": sum(r["cached"] for r in results) / prompt if prompt else 0.0}


def run(args, folder, docs, start_server, rss_mb, request) -> None:
    """Each --clients count: lmkit serve with the prefix cache (--cache-memory 1 GiB) and without, one untimed pass
    then --repeat timed ones, the median pass by tokens/s printed."""
    print(f"workload {args.workload}: " + ("conversations of %d turns after one shared system prompt" % args.turns
                                           if args.workload == "chat" else "3 passages of 4 topics and a question"))
    print(f"{'clients':>7} {'side':>10} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8} {'wall':>6} "
          f"{'requests':>8} {'prompt tok':>10} {'cached':>7}")
    for n in args.clients:
        rows = {}
        for side, memory in (("cache", "1"), ("no cache", "0")):
            process, url = start_server("lmkit", folder, args.threads, max(16, n), args.prefill_chunk,
                                        extra=["--cache-memory", memory])
            try:
                passes = [asyncio.run(drive(request, url, args.workload, docs, n, args.turns, args.max_tokens, p))
                          for p in range(args.repeat + 1)][1:]
                rows[side] = sorted(passes, key=lambda r: r["tok_s"])[len(passes) // 2]
                rows[side]["rss"] = rss_mb(process.pid)
            finally:
                process.terminate()
                process.wait(timeout=30)
        for side, r in rows.items():
            print(f"{n:>7} {side:>10} {r['tok_s']:>8.1f} {r['ttft_p50'] * 1e3:>7.1f}ms {r['ttft_p99'] * 1e3:>7.1f}ms "
                  f"{r['itl_p99'] * 1e3:>6.1f}ms {r['wall']:>5.2f}s {r['requests']:>8} {r['prompt_tokens']:>10} "
                  f"{r['hit']:>6.0%}   peak RSS {r['rss']:.0f} MB")
        print(f"{n:>7} cache / no cache: throughput {rows['cache']['tok_s'] / rows['no cache']['tok_s']:.2f}x, "
              f"TTFT p50 {rows['cache']['ttft_p50'] / rows['no cache']['ttft_p50']:.2f}x", flush=True)
