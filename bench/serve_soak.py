"""The soak of `bench_serve.py --soak SECONDS`: many clients send random requests to one `lmkit serve` for SECONDS
while the server's resident memory is sampled every second.

Each client loops over requests drawn at random: prompts of random length (text or token ids), greedy or sampled
(temperature, top_p, top_k, seeds, stop strings, n, logprobs, echo), streamed or not, some streams dropped by the
client after a few events, and bad requests (invalid JSON, unknown or malformed fields, prompts past the context,
chat on a folder without a template, unknown routes). Every answer is sorted: complete (200 and every choice
finished, a stream ending in [DONE]), a clear error (a 4xx with OpenAI's error body, 429 with Retry-After), a drop
the client made, or a failure (anything else: a 5xx, a body without the error shape, a stream cut short, a bad
request answered 200, a timeout). A good run has no failure, and once the clients stop the server reports no
request running or waiting.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path


def _rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _sampling(rng: random.Random) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 64)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        body.update(rng.choice([{}, {"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}]))
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 10 ** 6)
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["\n"], ["the", "."], ["e"], "ing"])
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["logprobs"] = rng.choice([0, 1, 3])
        body["echo"] = rng.random() < 0.3
    if rng.random() < 0.2:
        body[rng.choice(["presence_penalty", "frequency_penalty"])] = 0.5
    if rng.random() < 0.1:
        body["repetition_penalty"] = 1.2
    return body


def _bad_request(rng: random.Random, prompt: str) -> tuple[str, str, bytes | None]:
    """(method, path, body) of a request the server must refuse with a 4xx."""
    choices = [
        ("POST", "/v1/completions", b'{"prompt": "unterminated'),
        ("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8, "temprature": 0.5}).encode()),
        ("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": -3}).encode()),
        ("POST", "/v1/completions", json.dumps({"prompt": prompt, "temperature": "hot"}).encode()),
        ("POST", "/v1/completions", json.dumps({"prompt": "word " * 600, "max_tokens": 16}).encode()),
        ("POST", "/v1/completions", json.dumps({"prompt": [10 ** 9], "max_tokens": 4}).encode()),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()),
        ("GET", "/v1/no-such-route", None),
        ("GET", "/v1/completions", None),
    ]
    return rng.choice(choices)


def _clear_error(status: int, headers, text: str, codes: Counter) -> bool:
    """Whether this is a 4xx with OpenAI's error body (429: and Retry-After); counts it in `codes` by status."""
    if not 400 <= status < 500:
        return False
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        return False
    if status == 429 and "retry-after" not in headers:
        return False
    codes[f"{status} {error.get('code')}"] += 1
    return True


def _complete(body: dict, n: int) -> bool:
    choices = body.get("choices")
    return isinstance(choices, list) and len(choices) == n and all(
        c.get("finish_reason") in ("stop", "length") for c in choices)


async def _one(client, rng: random.Random, url: str, docs: list[str], tally: dict, codes: Counter,
               failures: list) -> None:
    doc = rng.choice(docs)
    start = rng.randrange(max(1, len(doc) - 50))
    prompt = doc[start:start + rng.randint(1, 1600)] or "x"
    roll = rng.random()
    try:
        if roll < 0.15:
            method, path, content = _bad_request(rng, prompt)
            response = await client.request(method, url + path, content=content,
                                            headers={"content-type": "application/json"})
            clear = _clear_error(response.status_code, response.headers, response.text, codes)
            kind = "clear error" if clear else "failure"
            if kind == "failure":
                failures.append(f"bad request {path} {content[:60] if content else ''}: HTTP {response.status_code} "
                                f"{response.text[:200]}")
            tally[kind] += 1
            return
        body = {"prompt": prompt if roll < 0.85 else [rng.randrange(4000) for _ in range(rng.randint(1, 300))],
                **_sampling(rng)}
        n = body.get("n", 1)
        if rng.random() < 0.5:
            response = await client.post(url + "/v1/completions", json=body)
            if response.status_code == 200 and _complete(response.json(), n):
                tally["complete"] += 1
            elif _clear_error(response.status_code, response.headers, response.text, codes):
                tally["clear error"] += 1
            else:
                tally["failure"] += 1
                failures.append(f"HTTP {response.status_code} {response.text[:200]} for {json.dumps(body)[:200]}")
            return
        body.update(stream=True, stream_options={"include_usage": True})
        drop_after = rng.randint(1, 6) if rng.random() < 0.25 else None
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                kind = "clear error" if _clear_error(response.status_code, response.headers, text, codes) else "failure"
                tally[kind] += 1
                if kind == "failure":
                    failures.append(f"stream HTTP {response.status_code} {text[:200]}")
                return
            events, finished, done = 0, set(), False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                events += 1
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finished.add(choice["index"])
                if drop_after is not None and events >= drop_after:
                    tally["dropped by the client"] += 1
                    return  # leaving the block closes the connection mid-stream
            if done and len(finished) == n:
                tally["complete"] += 1
            else:
                tally["failure"] += 1
                failures.append(f"stream ended without [DONE] or a finish reason per choice: {json.dumps(body)[:200]}")
    except Exception as exc:  # noqa: BLE001 - a transport error or timeout is a failure to report, not to raise
        tally["failure"] += 1
        failures.append(f"{type(exc).__name__}: {exc}")


async def soak(url: str, pid: int, docs: list[str], seconds: float, clients: int = 24, seed: int = 0) -> dict:
    """Run the clients for `seconds`; the tallies, a few failures and the server's RSS samples (seconds, MB)."""
    import httpx

    tally = {"complete": 0, "clear error": 0, "dropped by the client": 0, "failure": 0}
    codes: Counter = Counter()
    failures: list[str] = []
    samples: list[tuple[float, float]] = []
    began = time.monotonic()
    deadline = began + seconds

    async def worker(k: int, client) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            throttled = codes["429 queue_full"]
            await _one(client, rng, url, docs, tally, codes, failures)
            if codes["429 queue_full"] > throttled:  # as OpenAI's clients do: back off before retrying
                await asyncio.sleep(rng.uniform(0.5, 1.5))

    async def sampler() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - began, _rss_mb(pid, "VmRSS")))
            await asyncio.sleep(1.0)

    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients + 8)) as client:
        await asyncio.gather(sampler(), *(worker(k, client) for k in range(clients)))
        idle = None
        for _ in range(100):  # the dropped streams' slots are freed at the engine's next step
            text = (await client.get(url + "/metrics")).text
            gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith(("lmkit_requests_running ", "lmkit_requests_waiting "))}
            if gauges.get("lmkit_requests_running") == 0 and gauges.get("lmkit_requests_waiting") == 0:
                idle = True
                break
            await asyncio.sleep(0.1)
    return {"tally": tally, "codes": codes, "failures": failures, "samples": samples, "peak": _rss_mb(pid, "VmHWM"),
            "seconds": time.monotonic() - began, "idle after": bool(idle)}


def report(result: dict) -> None:
    samples, tally = result["samples"], result["tally"]
    first = [mb for t, mb in samples if t < 60]
    last_start = samples[-1][0] - 60 if samples else 0
    last = [mb for t, mb in samples if t >= last_start]
    print(f"soak of {result['seconds']:.0f} s: {sum(tally.values())} requests: "
          + ", ".join(f"{v} {k}" for k, v in tally.items()))
    print("  clear errors: " + ", ".join(f"{v} x {k}" for k, v in result["codes"].most_common()))
    for line in result["failures"][:10]:
        print("  failure:", line)
    print(f"server RSS: peak {result['peak']:.0f} MB (VmHWM); first minute {min(first):.0f} to {max(first):.0f} MB, "
          f"last minute {min(last):.0f} to {max(last):.0f} MB; no request running or waiting after the clients "
          f"stopped: {result['idle after']}")
    minutes = {}
    for t, mb in samples:
        minutes[int(t // 60)] = max(minutes.get(int(t // 60), 0.0), mb)
    print("  highest RSS per minute (MB): " + " ".join(f"{mb:.0f}" for _, mb in sorted(minutes.items())))
