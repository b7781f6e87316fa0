"""Timing harnesses for the benchmarks (``freetoken bench cpu-moe``, ``decode``, ``moe-layer``):
not part of the kernel API.

:func:`measure_bandwidth` is the machine's memory read bandwidth, measured the way the
kernels read memory: every worker of the pool streams its contiguous share of a buffer
far larger than the caches with the active tier's widest loads (XOR-folded so the loads
cannot be optimised away); the best of several passes is the ceiling the expert kernels
are compared against.

:func:`drive_handoffs` plays the GPU's part of the hand-off protocol from a native host
thread (raise ``ready``, wait for ``done``, reset it) against a running
:class:`~freetoken_cpu_moe.Coordinator`; :func:`time_run_task` runs the same tasks
synchronously from a native loop. The difference between the two is what the
coordinator adds (seeing ``ready``, waking the pool, releasing ``done``), free of
Python's call overhead; ``freetoken bench moe-layer`` reports both next to the GPU
hand-off.

:func:`time_dot_rows` times one weight kernel on the calling thread alone (no pool,
no activation preparation): the per-core compute rate when the weights fit in L2,
the single-core streaming rate when they do not.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.coordinator import _addr
from freetoken_cpu_moe.pool import Pool, default_pool

__all__ = ["drive_handoffs", "measure_bandwidth", "time_dot_rows", "time_run_task"]


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, pool: Optional[Pool] = None) -> float:
    """Best read bandwidth in bytes/s over ``repeats`` full passes of an ``nbytes`` buffer."""
    pool = pool or default_pool()
    nbytes = max(64, nbytes // 64 * 64)
    # every page written (mapped) and different from every other page, so that no
    # same-page merging (KSM, hypervisor dedup) can serve the reads from a cache
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.view(np.uint64)[:] = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    addr = int(buf.__array_interface__["data"][0])
    _core.stream_read(addr, nbytes, pool._core)  # warm-up pass
    best = 0.0
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        _core.stream_read(addr, nbytes, pool._core)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def drive_handoffs(tasks: Sequence[Any], rounds: int, timeout_ms: float = 5000.0) -> list[int]:
    """For each round and each task in order: ``ready = 1``, wait ``done != 0``, ``done = 0``.

    ``tasks``: descriptor addresses or HandoffTasks, all registered with a running
    coordinator. Returns the nanoseconds from each ``ready`` store to ``done`` seen.
    Raises RuntimeError when a hand-off times out or reports an error.
    """
    if rounds < 0:
        raise ValueError(f"drive_handoffs: rounds must be >= 0, got {rounds}")
    return list(_core.drive_handoffs([_addr(t) for t in tasks], int(rounds), float(timeout_ms)))


def time_run_task(tasks: Sequence[Any], rounds: int, pool: Optional[Pool] = None) -> list[int]:
    """``run_task`` on each task in order, ``rounds`` times, from a native loop; ns per call."""
    if rounds < 0:
        raise ValueError(f"time_run_task: rounds must be >= 0, got {rounds}")
    pool = pool or default_pool()
    return list(_core.time_run_task([_addr(t) for t in tasks], int(rounds), pool._core))


def time_dot_rows(weights: Any, x: Any, rounds: int, isa: Optional[str] = None) -> list[int]:
    """One kernel on the calling thread alone: every row of every expert of ``weights``
    against the float32 activations ``x`` [T, cols] (prepared once, outside the timing),
    ``rounds`` times; ns per round. A bank that fits in L2 measures the kernel's compute
    rate, one far larger than the caches its single-thread streaming rate.
    """
    if rounds < 0:
        raise ValueError(f"time_dot_rows: rounds must be >= 0, got {rounds}")
    xa = np.ascontiguousarray(x, dtype=np.float32)
    if xa.ndim != 2 or xa.shape[1] != weights.cols:
        raise ValueError(f"time_dot_rows: x must be [T, {weights.cols}] float32, got {tuple(xa.shape)}")
    return list(_core.time_dot_rows(weights.address, xa.ctypes.data, xa.shape[0], int(rounds), isa or ""))
