"""Prometheus metrics of the HTTP server (one registry per app, text format at /metrics)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reads the engine's live state at scrape time (running, queued, KV cache)."""

    def __init__(self, stats: Callable[[], Optional[Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Any]:
        stats = self._stats()
        values = {
            "freetoken_requests_running": ("Requests being generated (in the running batch).", "num_running"),
            "freetoken_requests_waiting": ("Requests queued for a batch slot.", "num_waiting"),
            "freetoken_kv_cache_usage_ratio": ("Fraction of KV cache tokens in use (0..1).", "kv_cache_usage"),
            "freetoken_kv_cache_used_tokens": ("KV cache tokens in use.", "kv_used_tokens"),
            "freetoken_kv_cache_total_tokens": ("KV cache capacity in tokens.", "kv_total_tokens"),
        }
        for name, (doc, attr) in values.items():
            family = GaugeMetricFamily(name, doc)
            value = getattr(stats, attr, None) if stats is not None else None
            family.add_metric([], float(value) if value is not None else 0.0)
            yield family
        counters = {
            "freetoken_engine_requests": ("Requests added to the engine (one per choice).", "requests_added"),
            "freetoken_engine_prompt_tokens": ("Prompt tokens of the requests added to the engine.",
                                               "prompt_tokens_added"),
        }
        for name, (doc, attr) in counters.items():
            value = getattr(stats, attr, None) if stats is not None else None
            yield CounterMetricFamily(name, doc, value=float(value) if value is not None else 0.0)


class ServerMetrics:
    """All series the server exports; ``engine_stats`` returns EngineStats or None while loading."""

    def __init__(self, engine_stats: Callable[[], Optional[Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "freetoken_http_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            "freetoken_request_finished", "Generation requests finished, by finish reason.", ["finish_reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "freetoken_requests_cancelled", "Engine requests cancelled before finishing (client gone or failed).",
            registry=r,
        )
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds", "Time from request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "freetoken_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "freetoken_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS, registry=r,
        )
        r.register(_EngineCollector(engine_stats))

    def observe_status(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """Per-choice timing: feeds TTFT, inter-token latency and token counters."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last: Optional[float] = None

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
            # Several tokens in one delta: spread the gap evenly over them.
        else:
            gap = (now - self._last) / count
            for _ in range(count):
                self._m.itl.observe(gap)
        self._last = now
        self._m.generation_tokens.inc(count)

    def finish(self, reason: Optional[str], now: float) -> None:
        self._m.finished.labels(finish_reason=reason or "unknown").inc()
        self._m.e2e.observe(now - self._arrival)
