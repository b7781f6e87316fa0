"""The engine's own host threads, kept off the cores of the CPU expert workers.

The coordinator pins its workers to distinct physical cores and leaves the rest free
(``coordinator.free_cpus()``). The thread that launches a step's GPU work and waits for
its tokens, and the thread that enqueues expert copies, would otherwise go wherever the
OS scheduler puts them: on a worker's core they take turns with the worker in slices of
milliseconds, and a hand-off whose worker is off its core waits that long. A
:class:`HostThreads` pins such threads to the free CPUs and gives each its former CPU set
back when the session closes.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Optional

log = logging.getLogger(__name__)


class HostThreads:
    """Pins threads to ``cpus`` (Linux CPU affinity), each once, until :meth:`release`."""

    def __init__(self, cpus: Iterable[int]) -> None:
        self.cpus = frozenset(int(c) for c in cpus)
        self._kept: dict[int, tuple[threading.Thread, set[int]]] = {}  # native id -> (thread, former CPUs)
        self._failed: Optional[str] = None
        self._lock = threading.Lock()

    @property
    def refusal(self) -> Optional[str]:
        """Why no thread is pinned, or None."""
        if not hasattr(os, "sched_setaffinity"):
            return "this OS sets no thread CPU affinity"
        if not self.cpus:
            return "no CPU is free of expert workers (they are not pinned, or take every core)"
        return self._failed

    @property
    def threads(self) -> int:
        """How many threads are pinned now."""
        return len(self._kept)

    def keep(self, thread: Optional[threading.Thread] = None) -> None:
        """Pin ``thread`` (default: the calling thread) to the free CPUs, if not done yet."""
        thread = thread or threading.current_thread()
        tid = thread.native_id
        if tid is None or tid in self._kept or self.refusal is not None or not thread.is_alive():
            return
        with self._lock:
            if tid in self._kept:
                return
            try:
                former = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, self.cpus)
            except OSError as e:
                self._failed = f"setting thread {thread.name!r}'s CPU affinity failed: {e}"
                log.warning("host threads stay where the OS puts them: %s", self._failed)
                return
            self._kept[tid] = (thread, former)
            log.debug("thread %r pinned to CPUs %s (was %s)", thread.name, sorted(self.cpus), sorted(former))

    def release(self) -> None:
        """Give each pinned thread that is still alive its former CPU set back."""
        with self._lock:
            kept, self._kept = self._kept, {}
        for tid, (thread, former) in kept.items():
            if not thread.is_alive():
                continue
            try:
                os.sched_setaffinity(tid, former)
            except OSError as e:  # the thread ended between the check and the call
                log.debug("thread %r: former CPU affinity not restored: %s", thread.name, e)

    def describe(self) -> dict[str, object]:
        return {"cpus": sorted(self.cpus), "threads": self.threads, "because": self.refusal}
