"""Timing the CPU side of the hand-off without a GPU.

:func:`drive_handoffs` plays the GPU's part of the protocol from a native host thread
(raise ``ready``, wait for ``done``, reset it) against a running :class:`Coordinator`;
:func:`time_run_task` runs the same tasks synchronously from a native loop. The
difference between the two is what the coordinator adds (seeing ``ready``, waking the
pool, releasing ``done``), free of Python's call overhead; ``freetoken bench moe-layer``
reports both next to the GPU hand-off.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.coordinator import _addr
from freetoken_cpu_moe.pool import Pool, default_pool


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
