"""The built-in cpu backend against the contract: buffers, the synchronous hand-off."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from freetoken import handoff
from freetoken.backends.handoff_io import HandoffError, SyncMode
from freetoken_cpu_moe.backend import CpuBackend, SynchronousSync

from toy_expert_worker import Worker, random_inputs, reference_output, serve_once


@pytest.fixture
def backend() -> CpuBackend:
    return CpuBackend()


def _fill(task, seed):
    """Fresh random inputs into the task, y poisoned; returns the float64 reference."""
    x, ids, w = random_inputs(task.max_tokens, task.hidden, task.top_k, experts=16, seed=seed)
    task.x.copy_(torch.from_numpy(x))
    task.ids.copy_(torch.from_numpy(ids))
    task.w.copy_(torch.from_numpy(w))
    task.y.fill_(float("nan"))  # poison: a hand-off that never wrote y cannot pass
    return reference_output(x, ids, w)


def _task(backend, tokens=5, hidden=48, top_k=4, seed=0):
    task = backend.staging().new_task(layer=3, slot=1, max_tokens=tokens, top_k=top_k, hidden=hidden,
                                      act_dtype=torch.float32, out_dtype=torch.float32)
    return task, _fill(task, seed)


def test_probe_and_capabilities(backend):
    probe = CpuBackend.probe()
    assert probe.available and probe.device_name == "cpu"
    caps = backend.capabilities()
    assert caps.stream_memops is False and caps.mapped_memory is False and caps.graph_capture is False
    assert backend.kernel_io() is None and backend.graph_capture() is None
    assert backend.device() == torch.device("cpu")


@pytest.mark.parametrize("nbytes", [1, 64, 1000, 1 << 20])
def test_alloc_host_is_aligned_writable_and_unmapped(backend, nbytes):
    buf = backend.staging().alloc_host(nbytes, mapped=True)
    assert buf.host_ptr % 128 == 0 and buf.nbytes == nbytes and buf.tensor.numel() == nbytes
    assert buf.mapped is False and buf.device_ptr == 0  # no device to map into, and it says so
    buf.tensor.fill_(0xA5)
    assert ctypes.string_at(buf.host_ptr, nbytes) == b"\xa5" * nbytes


def test_alloc_host_rejects_empty(backend):
    with pytest.raises(ValueError, match="positive size"):
        backend.staging().alloc_host(0)


def test_task_descriptor_points_at_its_buffers(backend):
    task, _ = _task(backend)
    desc = task.desc
    assert desc.abi_version == handoff.ABI_VERSION and (desc.layer, desc.slot) == (3, 1)
    assert (desc.x, desc.ids, desc.w, desc.y) == tuple(t.data_ptr() for t in (task.x, task.ids, task.w, task.y))
    assert desc.flag_slot == task.flag_addr and desc.flag_slot % 64 == 0
    assert desc.act_dtype == handoff.Fmt.F32 and (desc.max_tokens, desc.top_k, desc.hidden) == (5, 4, 48)
    assert (task.flags.ready, task.flags.done, task.flags.err) == (0, 0, 0)


def test_handoff_with_a_worker_thread(backend):
    sync = backend.gpu_sync()
    assert sync.mode is SyncMode.SYNCHRONOUS
    task, _ = _task(backend)
    for round_ in range(3):  # the slot is reusable: flags come back to zero
        expected = _fill(task, seed=100 + round_)
        with Worker(task, delay_s=0.01):
            sync.publish(0, task)
            sync.wait(0, task)
        np.testing.assert_allclose(task.y.numpy(), expected, rtol=1e-6, atol=1e-6)
        assert (task.flags.ready, task.flags.done, task.flags.seq) == (0, 0, round_ + 1)


def test_handoff_served_inline(backend):
    task, expected = _task(backend, seed=7)
    sync = SynchronousSync(serve=serve_once)
    sync.publish(0, task)
    assert task.flags.done == 1  # served during publish
    sync.wait(0, task)
    np.testing.assert_allclose(task.y.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_wait_without_a_server_times_out_with_an_error(backend):
    task, _ = _task(backend)
    sync = SynchronousSync(timeout_s=0.05)
    sync.publish(0, task)
    with pytest.raises(HandoffError, match="did not finish within 0.05 s"):
        sync.wait(0, task)


def test_cpu_side_error_is_raised_and_cleared(backend):
    task, _ = _task(backend)

    def failing_serve(t) -> None:
        t.flags.ready = 0
        t.flags.err = handoff.Err.CPU_EXCEPTION
        t.flags.done = 1

    sync = SynchronousSync(serve=failing_serve)
    sync.publish(0, task)
    with pytest.raises(HandoffError, match="layer 3 slot 1: CPU_EXCEPTION"):
        sync.wait(0, task)
    assert (task.flags.err, task.flags.done) == (0, 0)


def test_publish_twice_without_wait_is_refused(backend):
    task, _ = _task(backend)
    sync = SynchronousSync()
    sync.publish(0, task)
    with pytest.raises(HandoffError, match="every publish needs its wait"):
        sync.publish(0, task)


def test_unsupported_sync_mode(backend):
    with pytest.raises(ValueError, match="only 'synchronous'"):
        backend.gpu_sync(SyncMode.STREAM_MEMOPS)


def test_register_host_locks_or_says_why_and_fetch_copies(backend):
    bank = torch.randn(1 << 16)
    handle = backend.staging().register_host(bank)
    assert handle.locked or "RLIMIT_MEMLOCK" in handle.reason
    dst = torch.full((1 << 16,), float("nan"))
    backend.staging().fetch(0, dst, bank)
    assert torch.equal(dst, bank)
    handle.close()
    assert not handle.locked
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        backend.staging().register_host(torch.randn(8, 8).t())
