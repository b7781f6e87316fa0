"""The threading knobs of the CPU backend: the pool's spin time (set to 0 while torch's
threads own the cores) and the torch thread count for prompt steps."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cpu_moe_cases import E, H, cm
from cpu_moe_reference import make_weights, moe_error, random_routes

from freetoken_cpu_moe.backend import TORCH_THREADS_ENV, prefill_torch_threads


def test_pool_spin_time_is_settable_and_sleeping_workers_wake(rng) -> None:
    raw = make_weights("q8_0", 1, 96, 256, rng, 0.1)
    w = cm.Weights(raw.data, "q8_0", 1, 96, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    with cm.Pool(1) as one, cm.Pool(3) as pool:
        assert pool.spin_us == pytest.approx(2000.0)
        pool.spin_us = 0.0
        assert pool.spin_us == 0.0
        pool.spin_us = -5.0  # clamped
        assert pool.spin_us == 0.0
        want = cm.linear(w, x, pool=one)
        for _ in range(3):  # the workers sleep between calls and must wake for each
            time.sleep(0.01)
            assert np.array_equal(cm.linear(w, x, pool=pool), want)


def test_prompt_torch_threads_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(TORCH_THREADS_ENV, raising=False)
    assert prefill_torch_threads() == 1
    monkeypatch.setenv(TORCH_THREADS_ENV, "4")
    assert prefill_torch_threads() == 4
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(TORCH_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=TORCH_THREADS_ENV):
            prefill_torch_threads()


def test_item_jobs_do_not_wait_for_a_late_worker(bank_for, rng) -> None:
    """A worker whose core the OS lent elsewhere (here: one that sleeps 1.5 s before it
    joins the next job) holds up neither parallel_for (linear) nor run_phases (MoE): the
    items are done by the others and the call returns; the late worker then finds the job
    closed and joins a later one. run() (stream_read) still waits for every worker."""
    from freetoken_cpu_moe import _core

    case = bank_for("q4_k")
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids, w = random_routes(rng, 5, 4, E)
    raw = make_weights("q8_0", 1, 512, 256, rng, 0.1)
    lin = cm.Weights(raw.data, "q8_0", 1, 512, 256)
    with cm.Pool(1) as one, cm.Pool(3, pin=False) as pool:
        want_lin = cm.linear(lin, x, pool=one)
        want_moe = cm.moe_forward(case.bank, x, ids, w, pool=one)
        pool.spin_us = 0.0  # workers asleep between calls: each call wakes them
        calls = [(lambda: cm.linear(lin, x, pool=pool), want_lin),
                 (lambda: cm.moe_forward(case.bank, x, ids, w, pool=pool), want_moe)]
        for call, want in calls:
            pool._core._inject_worker_delay(2, 1500.0)
            time.sleep(0.01)
            t0 = time.perf_counter()
            got = [call() for _ in range(4)]  # the late worker wakes during or after these
            took = time.perf_counter() - t0
            assert took < 1.0, f"four calls took {took:.2f} s: they waited for the delayed worker"
            time.sleep(1.6)  # the late worker has woken and skipped the closed jobs
            got.append(call())
            for y in got:  # the split into items does not depend on who computes them
                assert np.array_equal(y, want)
        buf = np.arange(1 << 16, dtype=np.uint64)
        t0 = time.perf_counter()  # before the delay is set: the 300 ms count from here at the earliest
        pool._core._inject_worker_delay(1, 300.0)
        time.sleep(0.01)
        _core.stream_read(int(buf.__array_interface__["data"][0]), buf.nbytes, pool._core)
        assert time.perf_counter() - t0 >= 0.29, "run() returned before every worker had run"
    assert moe_error(want_moe, case.raw, x.astype(np.float64), ids, w) < 1e-3


def test_coordinator_spin_time_reaches_its_own_pool() -> None:
    from freetoken_cpu_moe.host_experts import HostExperts

    with cm.Pool(2, pin=False) as shared:
        experts = HostExperts(shared)
        own = experts.coordinator(threads=1, spin_us=20_000.0)
        try:
            assert own.pool is not shared and own.pool.spin_us == 20_000.0
        finally:
            own.stop()
            own.pool.close()
        same = experts.coordinator(threads=2, spin_us=20_000.0)
        try:  # the shared pool keeps its own spin time
            assert same.pool is shared and shared.spin_us == 2000.0
        finally:
            same.stop()
