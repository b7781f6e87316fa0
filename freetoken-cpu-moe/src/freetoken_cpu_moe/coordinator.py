"""The hand-off coordinator: serves tasks whose ``ready`` flag a GPU raised.

A native thread polls the flag slots of its tasks and follows the protocol of
``freetoken/handoff.h``: sees ``ready == 1`` (acquire), sets ``ready = 0``, runs
the task on the worker pool, writes y, increments ``seq`` and release-stores
``done = 1``. It spins while hand-offs keep coming (``spin_us`` after the last
one) and then sleeps with a growing interval (up to 1 ms), so an idle server
burns no core. A second native thread is the watchdog: a task whose ``ready``
has been up longer than ``watchdog_ms`` without being served gets
``err = FT_ERR_WATCHDOG`` and ``done = 1``; a descriptor that fails validation
gets ``FT_ERR_BAD_TASK``, a failure inside the compute ``FT_ERR_CPU_EXCEPTION``.
``seq`` counts every completed hand-off, errors included. The host side raises
on ``err`` with ``HandoffTask.check_error()``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, NamedTuple, Optional

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.pool import Pool, default_pool

log = logging.getLogger(__name__)

#: After the last hand-off, keep polling without sleeping for this long (microseconds).
DEFAULT_SPIN_US = 2000.0

_live: "weakref.WeakSet[Coordinator]" = weakref.WeakSet()


class ServeRecord(NamedTuple):
    """One served hand-off, as the poll thread saw it; times are ``time.monotonic_ns()``."""

    desc: int  #: descriptor address
    claim_ns: int  #: ready seen and claimed
    run_ns: int  #: task computed, y written
    done_ns: int  #: done released
    #: The slot's diagnostic GPU clock stamps read at claim (the KernelIO kernels write
    #: them; 0 otherwise): this hand-off's publish kernel entry and its stamp just before
    #: the fence, and for the previous hand-off on this slot when the GPU saw ``done`` and
    #: when it had read y. GPU clock: comparable with each other, not with the host times.
    gpu_publish_start_ns: int = 0
    gpu_ready_ns: int = 0
    gpu_prev_done_seen_ns: int = 0
    gpu_prev_y_read_ns: int = 0


class Coordinator:
    """Polls the flag slots of registered tasks and runs them (see module doc).

    The caller keeps every registered task's memory (descriptor, flag slot,
    buffers, bank) alive until :meth:`remove_task` returns or the coordinator
    is stopped.
    """

    def __init__(self, pool: Optional[Pool] = None, watchdog_ms: float = 2000.0, spin_us: float = DEFAULT_SPIN_US) -> None:
        if watchdog_ms <= 0:
            raise ValueError(f"Coordinator: watchdog_ms must be > 0, got {watchdog_ms}")
        self.pool = pool or default_pool()
        self.watchdog_ms = float(watchdog_ms)
        self._core = _core.Coordinator(self.pool._core, self.watchdog_ms, float(spin_us))
        _live.add(self)

    def add_task(self, desc_address: Any) -> None:
        """Serve the ``ft_task_desc`` at this address (idempotent)."""
        self._core.add_task(_addr(desc_address))

    def remove_task(self, desc_address: Any) -> None:
        """Stop serving a task; on return the coordinator no longer touches it."""
        self._core.remove_task(_addr(desc_address))

    def start(self) -> "Coordinator":
        self._core.start()
        log.debug("coordinator started (%d tasks, watchdog %.1f ms)", self._core.num_tasks, self.watchdog_ms)
        return self

    def stop(self) -> None:
        """Stop polling and join the threads (idempotent)."""
        self._core.stop()

    def free_cpus(self) -> list[int]:
        """The logical CPUs whose physical cores none of the workers (nor the poll
        thread) is pinned to (:meth:`freetoken_cpu_moe.pool.Pool.free_cpus`)."""
        return self.pool.free_cpus()

    @property
    def running(self) -> bool:
        return bool(self._core.running)

    @property
    def num_tasks(self) -> int:
        return int(self._core.num_tasks)

    def stats(self) -> dict[str, int]:
        """Counters: served (hand-offs completed), errors, watchdog_fired, sleeps, and
        busy_ns (time from claiming a task to releasing ``done``, summed)."""
        return dict(self._core.stats())

    def trace_start(self) -> None:
        """Record the next served hand-offs (up to 16384; clears the previous record)."""
        self._core.trace_start()

    def trace(self) -> list["ServeRecord"]:
        """The hand-offs served since :meth:`trace_start`, in order."""
        return [ServeRecord(*r) for r in self._core.trace()]

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.stop()


def _addr(desc: Any) -> int:
    """Accept an int address or a HandoffTask (its descriptor buffer)."""
    if isinstance(desc, int):
        return desc
    buf = getattr(desc, "desc_buffer", None)
    if buf is not None:
        return int(buf.host_ptr)
    raise TypeError(f"expected a descriptor address (int) or a HandoffTask, got {type(desc).__name__}")


def stop_all() -> None:
    """Stop every live coordinator (called at interpreter exit)."""
    for c in list(_live):
        try:
            c.stop()
        except Exception:  # pragma: no cover - best effort at exit
            log.exception("stopping a coordinator at exit failed")
