"""Host threads pinned to the CPUs the expert workers leave free (HostThreads, Pool.free_cpus).

Checked against the kernel's own record of each thread's CPU set (sched_getaffinity by
native thread id) and the sysfs topology, not against what the classes store."""

from __future__ import annotations

import os
import threading

import pytest

from freetoken.moe.session.host_threads import HostThreads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


class _Parked(threading.Thread):
    """A thread that waits until told to end."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.started_ev = threading.Event()

    def run(self) -> None:
        self.started_ev.set()
        self.stop.wait(30)


def test_pins_threads_and_gives_their_cpus_back() -> None:
    allowed = os.sched_getaffinity(0)
    target = {max(allowed)}
    other = _Parked()
    other.start()
    other.started_ev.wait(5)
    mine_before = os.sched_getaffinity(0)
    ht = HostThreads(target)
    try:
        assert ht.refusal is None
        ht.keep(other)
        ht.keep()  # the calling thread
        ht.keep()  # once only
        assert ht.threads == 2
        assert os.sched_getaffinity(other.native_id) == target
        assert os.sched_getaffinity(0) == target
    finally:
        ht.release()
    assert os.sched_getaffinity(0) == mine_before
    assert os.sched_getaffinity(other.native_id) == allowed
    assert ht.threads == 0
    other.stop.set()
    other.join(5)
    ht.keep(other)  # an ended thread: nothing to pin, and no failure recorded
    assert ht.threads == 0 and ht.refusal is None


def test_release_skips_threads_that_ended() -> None:
    other = _Parked()
    other.start()
    other.started_ev.wait(5)
    ht = HostThreads({min(os.sched_getaffinity(0))})
    ht.keep(other)
    other.stop.set()
    other.join(5)
    ht.release()  # no error for the ended thread
    assert ht.threads == 0


def test_refuses_without_free_cpus() -> None:
    ht = HostThreads([])
    assert "no CPU is free" in (ht.refusal or "")
    before = os.sched_getaffinity(0)
    ht.keep()
    assert ht.threads == 0 and os.sched_getaffinity(0) == before
    assert ht.describe() == {"cpus": [], "threads": 0, "because": ht.refusal}


def test_an_affinity_the_os_refuses_is_reported_not_raised() -> None:
    ht = HostThreads({10_000})  # no such CPU: EINVAL
    ht.keep()
    assert ht.threads == 0 and "affinity failed" in (ht.refusal or "")


def test_pool_free_cpus_are_on_cores_without_workers(physical_core) -> None:
    cm = pytest.importorskip("freetoken_cpu_moe")
    cores = cm.physical_core_cpus()
    allowed = sorted(os.sched_getaffinity(0))
    with cm.Pool(1) as one:
        taken = {physical_core(cores[0])}
        assert one.free_cpus() == [c for c in allowed if physical_core(c) not in taken]
        assert cores[0] not in one.free_cpus()
    with cm.Pool(len(cores)) as every:
        assert every.free_cpus() == []
    with cm.Pool(1, pin=False) as unpinned:
        assert unpinned.free_cpus() == []
