"""Prometheus metrics of the HTTP server (one registry per app, text format at /metrics).

Besides the request and token series, the scrape reads two things live: the engine's
queue and KV cache (:class:`EngineStats`), and the backend's startup decision and step
timings (the session's ``report()``, see :func:`backend_families`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from freetoken.server.moe_metrics import moe_families
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
            "freetoken_prefix_cache_cached_tokens": ("KV cache tokens held only by the prefix cache (no request "
                                                     "uses them; reused or evicted).", "kv_cached_tokens"),
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
            "freetoken_prefix_cache_queries": ("Prompt tokens of admitted requests looked up in the prefix cache "
                                               "(hit rate: hits / queries).", "prefix_cache_queries"),
            "freetoken_prefix_cache_hits": ("Prompt tokens found in the prefix cache (not computed).",
                                            "prefix_cache_hits"),
            "freetoken_engine_preemptions": ("Requests preempted for lack of KV cache (recomputed later).",
                                             "num_preemptions"),
        }
        for name, (doc, attr) in counters.items():
            value = getattr(stats, attr, None) if stats is not None else None
            yield CounterMetricFamily(name, doc, value=float(value) if value is not None else 0.0)


#: Labels of ``freetoken_backend_info``, in order: the report keys they come from.
BACKEND_INFO_LABELS = ("backend", "io_path", "sync_mode", "graphs", "act_dtype", "moe_cpu_layers")

#: Unit suffixes of the report's ``step_breakdown`` keys, and the factor to seconds.
_TIME_UNITS = {"_ns": 1e-9, "_us": 1e-6, "_ms": 1e-3, "_s": 1.0}


def _label(report: dict[str, Any], key: str) -> str:
    """A stable string label: "" where the report lacks the key, "none" where it holds None,
    "true"/"false" for booleans."""
    if key not in report:
        return ""
    value = report[key]
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _metric_part(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


def backend_families(report: dict[str, Any]) -> Iterable[Any]:
    """The series of a backend report (``LLMEngine.backend_info()``); only what it holds.

    * ``freetoken_backend_info{backend, io_path, sync_mode, graphs, act_dtype, moe_cpu_layers} 1``:
      the startup decision (the reason and warnings are text: see /health and the log);
    * ``freetoken_moe_gpu_layers``: MoE layers whose routed experts are on the GPU;
    * ``freetoken_cpu_wait_share``: share of a decode step the CPU expert workers are busy;
    * ``freetoken_step_breakdown_<part>_seconds``: the report's ``step_breakdown`` (medians
      over recent decode steps), e.g. ``decode_step`` and ``cpu_experts``;
    * ``freetoken_gpu_memory_<kind>_bytes``: the report's ``gpu_memory`` (allocated,
      max_allocated, reserved) and ``freetoken_gpu_memory_budget_bytes``: the memory plan's budget;
    * the MoE statistics and expert cache series of :mod:`freetoken.server.moe_metrics`.
    """
    if not report:
        return
    info = GaugeMetricFamily("freetoken_backend_info",
                             "The backend's startup decision for the served model (value 1).",
                             labels=list(BACKEND_INFO_LABELS))
    info.add_metric([_label(report, k) for k in BACKEND_INFO_LABELS], 1.0)
    yield info
    gauges: list[tuple[str, str, Optional[float]]] = [
        ("freetoken_moe_gpu_layers", "MoE layers whose routed experts are resident on the GPU.",
         _number(report.get("moe_gpu_layers"))),
        ("freetoken_cpu_wait_share", "Share of a decode step the CPU expert workers are busy (0..1, median of "
         "recent decode steps).", _number(report.get("cpu_wait_share"))),
    ]
    breakdown = report.get("step_breakdown")
    if isinstance(breakdown, dict):
        for key, value in breakdown.items():
            number = _number(value)
            unit = next((u for u in _TIME_UNITS if key.endswith(u)), None)
            if number is None or unit is None:
                continue
            part = _metric_part(key[: -len(unit)])
            gauges.append((f"freetoken_step_breakdown_{part}_seconds",
                           f"Decode step breakdown: {part.replace('_', ' ')} (median of recent decode steps).",
                           number * _TIME_UNITS[unit]))
    memory = report.get("gpu_memory")
    if isinstance(memory, dict):
        for key, value in memory.items():
            part = _metric_part(str(key))
            gauges.append((f"freetoken_gpu_memory_{part}_bytes", f"GPU memory {part.replace('_', ' ')} by this "
                           "process (torch allocator).", _number(value)))
    plan = report.get("memory_plan")
    if isinstance(plan, dict):
        gauges.append(("freetoken_gpu_memory_budget_bytes", "GPU memory this process may use (the memory plan's "
                       "budget).", _number(plan.get("budget"))))
    seen: set[str] = set()
    for name, doc, value in gauges:
        if value is not None and name not in seen:  # one family per name, whatever the report's keys
            seen.add(name)
            yield GaugeMetricFamily(name, doc, value=value)
    yield from moe_families(report)


class _BackendCollector(Collector):
    """Reads the backend report at scrape time (nothing while the model loads)."""

    def __init__(self, backend_info: Callable[[], dict[str, Any]]) -> None:
        self._backend_info = backend_info

    def collect(self) -> Iterable[Any]:
        yield from backend_families(self._backend_info())


class ServerMetrics:
    """All series the server exports; ``engine_stats`` returns EngineStats or None while loading,
    ``backend_info`` the backend report ({} while loading)."""

    def __init__(self, engine_stats: Callable[[], Optional[Any]],
                 backend_info: Optional[Callable[[], dict[str, Any]]] = None) -> None:
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
        if backend_info is not None:
            r.register(_BackendCollector(backend_info))

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
