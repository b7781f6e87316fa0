"""The machine's memory read bandwidth, measured the way the kernels read memory.

Every worker of the pool streams its contiguous share of a buffer far larger than
the caches with the active tier's widest loads (XOR-folded so the loads cannot be
optimised away); the best of several passes is the ceiling the expert kernels are
compared against (``freetoken bench cpu-moe``).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.pool import Pool, default_pool


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
