"""Prometheus series of the MoE statistics (``--moe-collect-stats``) and the expert cache,
from a backend report's ``moe_stats`` and ``expert_cache`` (only what it holds):

* ``freetoken_moe_routes_total{layer}``, ``freetoken_moe_gpu_routes_total{layer}`` (resident
  layers, cache hits, locked fetches), ``freetoken_moe_cpu_routes_total{layer}`` (misses the
  CPU workers computed): routes of the decode steps;
* ``freetoken_moe_active_experts{layer}``: distinct experts per decode step (mean);
* ``freetoken_moe_miss_rate``, ``freetoken_moe_decode_steps_total``,
  ``freetoken_moe_fetched_bytes_total``, ``freetoken_moe_fetched_experts_total``,
  ``freetoken_moe_streamed_bytes_total``, ``freetoken_moe_cpu_expert_seconds_total``;
* ``freetoken_moe_cache_slots`` and ``freetoken_moe_cache_experts`` (experts held now).
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_PER_LAYER = (
    ("routes", "freetoken_moe_routes", "Routes (token, expert) of the decode steps, per MoE layer.", "counter"),
    ("gpu_routes", "freetoken_moe_gpu_routes", "Routes computed on the GPU: resident layers, expert cache hits and "
     "locked fetches, per MoE layer.", "counter"),
    ("cpu_routes", "freetoken_moe_cpu_routes", "Routes the CPU expert workers computed (cache misses), per MoE "
     "layer.", "counter"),
    ("active_experts", "freetoken_moe_active_experts", "Distinct experts routed to per decode step (mean), per "
     "MoE layer.", "gauge"),
)
_TOTALS = (
    ("steps", "freetoken_moe_decode_steps", "Decode steps counted by the MoE statistics.", "counter"),
    ("miss_rate", "freetoken_moe_miss_rate", "Share of routes the CPU workers computed (0..1).", "gauge"),
    ("fetched_bytes", "freetoken_moe_fetched_bytes", "Bytes copied into the expert cache.", "counter"),
    ("fetched_experts", "freetoken_moe_fetched_experts", "Experts copied into the expert cache.", "counter"),
    ("streamed_bytes", "freetoken_moe_streamed_bytes", "Expert bytes streamed to the GPU for long prompts.",
     "counter"),
    ("cpu_expert_seconds", "freetoken_moe_cpu_expert_seconds", "Time the CPU expert workers were busy.", "counter"),
)


def moe_families(report: dict[str, Any]) -> Iterable[Any]:
    stats = report.get("moe_stats")
    if isinstance(stats, dict):
        per_layer = stats.get("per_layer") or {}
        for key, name, doc, kind in _PER_LAYER:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["layer"])
            for layer, values in per_layer.items():
                if values.get(key) is not None:
                    family.add_metric([str(layer)], float(values[key]))
            yield family
        for key, name, doc, kind in _TOTALS:
            value = stats.get(key)
            if value is not None:
                yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, value=float(value))
    cache = report.get("expert_cache")
    if isinstance(cache, dict):
        yield GaugeMetricFamily("freetoken_moe_cache_slots", "Slots of the GPU expert cache.",
                                value=float(cache.get("slots", 0)))
        yield GaugeMetricFamily("freetoken_moe_cache_experts", "Experts the GPU expert cache holds now.",
                                value=float(cache.get("cached_experts", 0)))
