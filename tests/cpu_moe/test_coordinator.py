"""The hand-off coordinator, driven from Python threads exactly as a GPU would:
inputs, ready = 1, wait done == 1, read y, done = 0."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from cpu_moe_cases import cm
from freetoken.backends.handoff_io import HandoffError
from cpu_moe_reference import moe_error, random_routes
from cpu_moe_tasks import err_name, fill_inputs, gpu_handoff, new_task
from freetoken_cpu_moe.timing import drive_handoffs, time_run_task


def thread_count() -> int:
    """Threads of this process that freetoken_cpu_moe started (its pool workers, coordinator
    and watchdog name themselves ``ft-*``): other libraries' threads, which earlier tests can
    leave starting or ending at any time, are not counted."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith("ft-")
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


def thread_count_after_join(want: int, timeout_s: float = 2.0) -> int:
    """:func:`thread_count` once it equals ``want`` or ``timeout_s`` passed: a joined thread
    stays listed in /proc/self/task for a moment after pthread_join returns (the kernel
    wakes the joiner before it finishes the task's exit), a leaked one stays for good."""
    end = time.monotonic() + timeout_s
    while (n := thread_count()) != want and time.monotonic() < end:
        time.sleep(0.002)
    return n


def one_handoff(case, task, rng, T: int) -> None:
    x = torch.from_numpy(rng.standard_normal((T, case.H)).astype(np.float32))
    ids, w = random_routes(rng, T, task.top_k, case.E)
    fill_inputs(task, x, ids, w)
    task.y.fill_(float("nan"))
    seq = task.flags.seq
    gpu_handoff(task)
    assert task.flags.seq == seq + 1
    task.check_error()
    tol = 1e-3 + (4e-3 if task.y.dtype == torch.bfloat16 else 0.0)  # see test_moe_matrix
    assert moe_error(task.y[:T].double().numpy(), case.raw, x.to(task.x.dtype).double().numpy(), ids, w) < tol


def test_many_consecutive_handoffs_on_one_slot(bank_for, rng) -> None:
    case = bank_for(("q4_k", "q4_k", "q6_k"))
    task = new_task(case.bank, max_tokens=16, top_k=8, act_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    with cm.Coordinator(watchdog_ms=5000) as coord:
        coord.add_task(task.desc_buffer.host_ptr)
        for i in range(150):
            one_handoff(case, task, rng, T=int(rng.integers(1, 17)))
        assert coord.stats()["served"] == 150
    assert task.flags.seq == 150 and task.flags.err == 0


def test_several_slots_from_several_threads(bank_for) -> None:
    cases = [bank_for("q8_0"), bank_for("bf16"), bank_for(("q5_k", "q5_k", "q6_k"))]
    tasks = [
        new_task(c.bank, max_tokens=4, top_k=2, act_dtype=dt, out_dtype=dt, layer=i)
        for i, (c, dt) in enumerate(zip(cases, [torch.float32, torch.bfloat16, torch.float16]))
    ]
    errors: list[BaseException] = []

    def gpu(case, task, seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                one_handoff(case, task, rng, T=int(rng.integers(1, 5)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    with cm.Coordinator(watchdog_ms=5000) as coord:
        for t in tasks:
            coord.add_task(t)
        threads = [threading.Thread(target=gpu, args=(c, t, i)) for i, (c, t) in enumerate(zip(cases, tasks))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors
    assert [t.flags.seq for t in tasks] == [60, 60, 60]


def test_watchdog_fails_an_unserved_task_then_recovers(bank_for, rng) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    with cm.Coordinator(watchdog_ms=30) as coord:
        coord.add_task(task)
        one_handoff(case, task, rng, T=2)
        coord._core._inject_stall_ms(600)  # the CPU side wedges
        time.sleep(0.01)
        t0 = time.monotonic()
        gpu_handoff(task, timeout_s=5)
        waited = time.monotonic() - t0
        assert err_name(task) == "WATCHDOG"
        assert waited < 0.5, f"the watchdog took {waited:.3f}s for a 30 ms bound"
        with pytest.raises(HandoffError, match="WATCHDOG"):
            task.check_error()
        assert coord.stats()["watchdog_fired"] == 1
        time.sleep(0.7)  # the stall ends; the slot works again
        one_handoff(case, task, rng, T=1)


def test_cpu_exception_and_bad_task_set_err(bank_for, rng) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    with cm.Coordinator(watchdog_ms=5000) as coord:
        coord.add_task(task)
        coord._core._inject_fault()
        fill_inputs(task, torch.randn(2, case.H), np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32))
        gpu_handoff(task)
        assert err_name(task) == "CPU_EXCEPTION"
        task.flags.err = 0
        task.ids[0, 0] = case.E + 3  # out of range: the descriptor's data is bad
        gpu_handoff(task)
        assert err_name(task) == "BAD_TASK"
        task.flags.err = 0
        one_handoff(case, task, rng, T=2)
        assert coord.stats()["errors"] == 2


def test_removed_task_is_not_served(bank_for, rng) -> None:
    case = bank_for("f16")
    a = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32, slot=0)
    b = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32, slot=1)
    with cm.Coordinator(watchdog_ms=40) as coord:
        coord.add_task(a)
        coord.add_task(b)
        one_handoff(case, b, rng, T=1)
        coord.remove_task(b)
        assert coord.num_tasks == 1
        fill_inputs(b, torch.randn(1, case.H), np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32))
        b.flags.ready = 1
        time.sleep(0.2)  # neither the loop nor the watchdog may touch b any more
        assert (b.flags.ready, b.flags.done, b.flags.err) == (1, 0, 0)
        b.flags.ready = 0
        one_handoff(case, a, rng, T=2)


def test_idle_coordinator_sleeps(bank_for, rng) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    with cm.Coordinator(watchdog_ms=1000) as coord:
        coord.add_task(task)
        one_handoff(case, task, rng, T=2)
        time.sleep(0.05)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(0.5)
        busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert coord.stats()["sleeps"] > 10
    assert busy < 0.2, f"an idle coordinator used {busy:.0%} of a core"


def test_start_stop_many_times_without_leaks(bank_for, rng) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    coord = cm.Coordinator(watchdog_ms=1000)
    coord.add_task(task)
    coord.start()  # warm-up: the default pool, BLAS/torch thread pools of the reference
    one_handoff(case, task, rng, T=1)
    coord.stop()
    time.sleep(0.1)  # the joined threads' exits finish (see thread_count_after_join)
    base = thread_count()
    for i in range(30):
        coord.start()
        assert coord.running and thread_count_after_join(base + 2) == base + 2
        if i % 10 == 0:
            one_handoff(case, task, rng, T=1)
        coord.stop()
        assert not coord.running and thread_count_after_join(base) == base
    for _ in range(10):  # whole objects, and private pools
        with cm.Pool(2) as pool, cm.Coordinator(pool=pool, watchdog_ms=1000) as c2:
            c2.add_task(task)
            one_handoff(case, task, rng, T=1)
            c2.remove_task(task)
        assert thread_count_after_join(base) == base


def test_clean_shutdown_at_interpreter_exit() -> None:
    code = (
        "import freetoken_cpu_moe as cm\n"
        "c = cm.Coordinator(watchdog_ms=100).start()\n"
        "p = cm.Pool(2)\n"
        "print('up', c.running, p.num_threads)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "up True 2" in out.stdout
    assert time.monotonic() - t0 < 30


def test_native_driver_trace_and_busy_time(bank_for, rng) -> None:
    """drive_handoffs plays the GPU from a native thread: every hand-off is served with
    the right result, counted, traced in order with ordered stage times, and its
    measured round trip covers the coordinator's own claim -> done span."""
    case = bank_for("q8_0")
    tasks = [new_task(case.bank, max_tokens=4, top_k=2, act_dtype=torch.bfloat16, out_dtype=torch.float32, layer=l)
             for l in range(3)]  # fmt: skip
    inputs = []
    for task in tasks:
        x = torch.from_numpy(rng.standard_normal((3, case.H)).astype(np.float32))
        ids, w = random_routes(rng, 3, 2, case.E)
        fill_inputs(task, x, ids, w)
        task.y.fill_(float("nan"))
        inputs.append((x, ids, w))
    rounds = 7
    with cm.Coordinator(watchdog_ms=5000) as coord:
        for task in tasks:
            coord.add_task(task)
        coord.trace_start()
        before = coord.stats()
        t0 = time.monotonic_ns()
        round_trips = drive_handoffs(tasks, rounds)
        t1 = time.monotonic_ns()
        after = coord.stats()
        trace = coord.trace()
    assert len(round_trips) == rounds * len(tasks) and all(ns > 0 for ns in round_trips)
    assert after["served"] - before["served"] == rounds * len(tasks)
    assert after["busy_ns"] > before["busy_ns"]
    assert [r.desc for r in trace] == [t.desc_buffer.host_ptr for t in tasks] * rounds
    for rec, rt in zip(trace, round_trips):
        assert t0 <= rec.claim_ns <= rec.run_ns <= rec.done_ns <= t1
        assert rec.done_ns - rec.claim_ns <= rt  # the driver's span contains the coordinator's
    for task, (x, ids, w) in zip(tasks, inputs):
        assert task.flags.seq == rounds and task.flags.err == 0 and task.flags.done == 0
        assert moe_error(task.y[:3].double().numpy(), case.raw, x.to(torch.bfloat16).double().numpy(), ids, w) < 1e-3


def test_native_driver_times_out_without_a_coordinator(bank_for) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=1, top_k=1, act_dtype=torch.float32, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="not done after"):
        drive_handoffs([task], 1, timeout_ms=20)
    task.flags.ready = 0


def test_time_run_task_computes_each_task(bank_for, rng) -> None:
    case = bank_for("bf16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    x = torch.from_numpy(rng.standard_normal((2, case.H)).astype(np.float32))
    ids, w = random_routes(rng, 2, 2, case.E)
    fill_inputs(task, x, ids, w)
    task.y.fill_(float("nan"))
    times = time_run_task([task], 4)
    assert len(times) == 4 and all(ns > 0 for ns in times)
    assert moe_error(task.y[:2].double().numpy(), case.raw, x.double().numpy(), ids, w) < 1e-3
