"""The server's Prometheus metrics, in a registry of its own (so that two servers in one process do not clash)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PrefixCounts:
    """vLLM's prefix-cache counters, read from the engine's cache at each scrape: prompt tokens looked up and of them
    found (hit rate = hits / queries)."""

    def __init__(self, prefix):
        self.prefix = prefix  # () -> the engine's PrefixCache, or None without one

    def collect(self):
        cache = self.prefix()
        queried, hits = (cache.queried, cache.hits) if cache is not None else (0, 0)
        yield CounterMetricFamily("lmkit_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=queried)
        yield CounterMetricFamily("lmkit_prefix_cache_hits", "prompt tokens the prefix cache served", value=hits)


class Metrics:
    def __init__(self, counts, prefix=lambda: None):
        """`counts()` returns (requests running, requests waiting), `prefix()` the engine's prefix cache (None: none),
        read at each scrape."""
        self.registry = CollectorRegistry()
        self.registry.register(PrefixCounts(prefix))
        running = Gauge("lmkit_requests_running", "requests in the running batch", registry=self.registry)
        waiting = Gauge("lmkit_requests_waiting", "requests waiting for a slot", registry=self.registry)
        running.set_function(lambda: counts()[0])
        waiting.set_function(lambda: counts()[1])
        self.prompt_tokens = Counter("lmkit_prompt_tokens", "prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter("lmkit_generation_tokens", "tokens generated", registry=self.registry)
        self.requests = Counter("lmkit_requests", "requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.time_to_first_token = Histogram("lmkit_time_to_first_token_seconds", "time from arrival to first token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("lmkit_inter_token_latency_seconds", "time between consecutive tokens",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
