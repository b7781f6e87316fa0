"""Persistent worker pool: one thread per physical core by default, pinned.

The thread that calls into the pool works too (as worker 0, not pinned); the
others are created once, spin briefly after each job (decode steps come back to
back) and then sleep until woken. Work is split dynamically across experts and
output rows so all workers finish together.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

from freetoken_cpu_moe import _core

log = logging.getLogger(__name__)

#: How long idle workers spin before sleeping (microseconds).
DEFAULT_SPIN_US = 2000.0


def _allowed_cpus() -> list[int]:
    """The logical CPUs the calling thread may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _core_of(cpu: int) -> tuple[str, str]:
    """(package, core) of a logical CPU; a CPU whose topology cannot be read is its own core."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as f:
            pkg = f.read().strip()
        with open(f"{base}/core_id") as f:
            core = f.read().strip()
    except OSError:
        return "?", str(cpu)
    return pkg, core


def physical_core_cpus() -> list[int]:
    """One logical CPU per physical core among the CPUs this process may use."""
    allowed = _allowed_cpus()
    seen: set[tuple[str, str]] = set()
    out: list[int] = []
    for cpu in allowed:
        core = _core_of(cpu)
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out or allowed


class Pool:
    """Persistent workers for the kernels.

    ``num_threads``: total workers including the calling thread (default: one per
    physical core this process may run on). ``pin``: pin the created workers to
    distinct physical cores.
    """

    def __init__(self, num_threads: Optional[int] = None, pin: bool = True, spin_us: float = DEFAULT_SPIN_US) -> None:
        cpus = physical_core_cpus()
        n = len(cpus) if num_threads is None else int(num_threads)
        if n < 1:
            raise ValueError(f"Pool: num_threads must be >= 1, got {num_threads}")
        if n > len(cpus):
            log.warning("Pool: %d threads on %d physical cores: workers will share cores", n, len(cpus))
        self.pin = bool(pin)
        self.cpus = cpus if pin else []
        self._allowed = _allowed_cpus()
        self._core = _core.Pool(n, self.cpus, float(spin_us))
        log.debug("worker pool: %d threads, pinned to %s", n, self.cpus[:n] if pin else "nothing")

    @property
    def num_threads(self) -> int:
        return int(self._core.num_threads)

    @property
    def spin_us(self) -> float:
        """How long idle workers spin after a job before they sleep (microseconds)."""
        return float(self._core.spin_us)

    @spin_us.setter
    def spin_us(self, us: float) -> None:
        self._core.spin_us = float(us)

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    def free_cpus(self) -> list[int]:
        """The logical CPUs (of those this pool was created on) whose physical cores hold
        none of its workers: where other threads of the process run without taking a
        worker's core (the caller counts as a worker: a coordinator pins it to
        ``cpus[0]``). Empty when the workers are not pinned or take every core."""
        if not self.cpus:
            return []
        n = self.num_threads
        taken = {_core_of(self.cpus[t % len(self.cpus)]) for t in range(n)}
        return [c for c in self._allowed if _core_of(c) not in taken]

    def close(self) -> None:
        """Join the workers (idempotent). A closed pool refuses work."""
        self._core.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool(num_threads={self.num_threads}, pin={self.pin}, closed={self.closed})"


_default_pool: Optional[Pool] = None
_default_lock = threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool (created on first use; closed at interpreter exit).

    ``FREETOKEN_CPU_MOE_THREADS`` overrides its size.
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            env = os.environ.get("FREETOKEN_CPU_MOE_THREADS")
            _default_pool = Pool(int(env) if env else None)
        return _default_pool


def coordinator_threads() -> int:
    """Workers of a hand-off coordinator (a GPU session's CPU experts) when none are asked
    for: ``FREETOKEN_CPU_MOE_THREADS``, else all physical cores this process may use but one,
    for the thread that launches the GPU's work and spins while it waits for the tokens (the
    pool pins its workers to distinct cores; every GPU measurement in docs/benchmarks.md ran
    with that core left free)."""
    env = os.environ.get("FREETOKEN_CPU_MOE_THREADS")
    if env:
        return int(env)
    return max(1, len(physical_core_cpus()) - 1)


def shutdown_default_pool() -> None:
    global _default_pool
    with _default_lock:
        if _default_pool is not None:
            _default_pool.close()
            _default_pool = None
