"""MoE statistics: what the router chose, where it ran, what moved.

:class:`RouteLog` keeps, on the device, the expert ids every MoE layer routed the tokens
of the last decode step to (one copy per layer, captured into decode graphs); the session
reads it once after the step. :class:`MoEStats` accumulates per layer: routes, routes
served on the GPU (resident layers, cache hits) and on the CPU (misses), distinct experts
per step; and in total: bytes fetched into the expert cache, bytes streamed for long
prompts, CPU expert time. Off by default; when off nothing is recorded or read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class RouteLog:
    def __init__(self, layers: list[int], max_tokens: int, top_k: int, device: Any) -> None:
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.max_tokens = max_tokens
        self.top_k = top_k
        self.buf = torch.full((len(self.layers), max_tokens, top_k), -1, dtype=torch.int32, device=device)

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """Keep ``ids [T, K]`` of ``layer`` (steps of more than ``max_tokens`` tokens are not kept)."""
        t = ids.shape[0]
        if t <= self.max_tokens:
            self.buf[self.index[layer], :t].copy_(ids)

    def read(self, tokens: int) -> np.ndarray:
        """``[layers, tokens, K]`` int32: the last recorded step's first ``tokens`` tokens."""
        return self.buf[:, :tokens].cpu().numpy()


def distinct_per_row(ids: np.ndarray) -> np.ndarray:
    """Number of distinct non-negative values in each row of a 2-D int array."""
    s = np.sort(ids, axis=1)
    new = np.ones_like(s, dtype=bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return (new & (s >= 0)).sum(axis=1)


class MoEStats:
    def __init__(self, layers: list[int], interval_s: float = 60.0) -> None:
        self.layers = list(layers)
        n = len(self.layers)
        self.steps = 0
        self.routes = np.zeros(n, dtype=np.int64)
        self.gpu_routes = np.zeros(n, dtype=np.int64)  # resident layers and cache hits
        self.cpu_routes = np.zeros(n, dtype=np.int64)  # CPU layers' routes not in the cache
        self.distinct = np.zeros(n, dtype=np.int64)  # sum over steps of distinct experts per step
        self.fetched_bytes = 0
        self.fetched_experts = 0
        self.streamed_bytes = 0
        self.cpu_expert_ns = 0
        self.interval_s = interval_s
        self._last_log = time.monotonic()

    def add_step(self, ids: np.ndarray, on_gpu: np.ndarray) -> None:
        """One decode step: ``ids [layers, T, K]``, ``on_gpu`` bool of the same shape."""
        valid = ids >= 0
        self.steps += 1
        self.routes += valid.sum(axis=(1, 2))
        self.gpu_routes += (on_gpu & valid).sum(axis=(1, 2))
        self.cpu_routes += (~on_gpu & valid).sum(axis=(1, 2))
        self.distinct += distinct_per_row(ids.reshape(ids.shape[0], -1))

    def snapshot(self) -> dict[str, Any]:
        routes = int(self.routes.sum())
        cpu = int(self.cpu_routes.sum())
        return {
            "steps": self.steps,
            "routes": routes,
            "gpu_routes": int(self.gpu_routes.sum()),
            "cpu_routes": cpu,
            "miss_rate": cpu / routes if routes else None,
            "fetched_bytes": self.fetched_bytes,
            "fetched_experts": self.fetched_experts,
            "fetched_bytes_per_step": self.fetched_bytes / self.steps if self.steps else None,
            "streamed_bytes": self.streamed_bytes,
            "cpu_expert_seconds": self.cpu_expert_ns / 1e9,
            "per_layer": {
                str(layer): {"routes": int(self.routes[i]), "gpu_routes": int(self.gpu_routes[i]),
                             "cpu_routes": int(self.cpu_routes[i]),
                             "active_experts": float(self.distinct[i]) / self.steps if self.steps else None}
                for i, layer in enumerate(self.layers)
            },
        }

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.interval_s:
            return
        self._last_log = now
        s = self.snapshot()
        active = [v["active_experts"] for v in s["per_layer"].values() if v["active_experts"] is not None]
        log.info(
            "MoE stats: %d decode steps, miss rate %s, %.1f distinct experts per layer and step, fetched %.1f MiB "
            "(%d experts), streamed %.1f MiB, CPU experts %.1f s",
            s["steps"], "-" if s["miss_rate"] is None else f"{s['miss_rate']:.3f}",
            float(np.mean(active)) if active else 0.0, s["fetched_bytes"] / 2**20, s["fetched_experts"],
            s["streamed_bytes"] / 2**20, s["cpu_expert_seconds"],
        )  # fmt: skip

