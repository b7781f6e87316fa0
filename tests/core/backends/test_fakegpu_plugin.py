"""The installed example third-party plugin: discovered, selected, and it keeps its ordering promises."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from freetoken.backends import registry
from freetoken.backends.discovery import PluginStatus

from toy_expert_worker import Worker, random_inputs, reference_output


def test_discovered_through_its_installed_metadata():
    records = {r.name: r for r in registry.plugins()}
    fake = records["fakegpu"]
    assert (fake.distribution, fake.status, fake.hardware) == ("freetoken-fakegpu", PluginStatus.AVAILABLE, "fakegpu")


def test_selected_by_environment_variable(monkeypatch):
    monkeypatch.setenv("FREETOKEN_BACKEND", "fakegpu")
    backend = registry.get_backend()
    assert backend.name == "fakegpu"
    assert registry.current_selection().rule == "FREETOKEN_BACKEND"


def test_probe_saying_absent_fails_explicit_selection(monkeypatch):
    monkeypatch.setenv("FREETOKEN_FAKEGPU_ABSENT", "1")
    with pytest.raises(registry.BackendSelectionError, match="simulated GPU is switched off"):
        registry.get_backend("fakegpu")


def test_stream_ordered_handoff():
    backend = registry.get_backend("fakegpu")
    stream = backend.current_stream()
    task = backend.staging().new_task(layer=0, slot=0, max_tokens=4, top_k=2, hidden=32,
                                      act_dtype=torch.float32, out_dtype=torch.float32)
    assert task.device_ptrs["x"] == task.x.data_ptr()  # mapped: the simulated device shares the address
    x, ids, w = random_inputs(4, 32, 2, experts=8, seed=11)
    expected = reference_output(x, ids, w)
    task.x.fill_(float("nan"))
    task.y.fill_(float("nan"))
    seen = torch.full((4, 32), float("nan"))
    from freetoken_fakegpu.stream import stream_for

    def produce() -> None:  # the "kernel" that writes the inputs, deliberately slow
        time.sleep(0.05)
        task.x.copy_(torch.from_numpy(x)); task.ids.copy_(torch.from_numpy(ids)); task.w.copy_(torch.from_numpy(w))

    sync = backend.gpu_sync()
    with Worker(task, delay_s=0.05):
        stream_for(stream).enqueue(produce)
        sync.publish(stream, task)  # ready only after produce() ran
        sync.wait(stream, task)  # later work only after done
        stream_for(stream).enqueue(lambda: seen.copy_(task.y))
        backend.synchronize()
    np.testing.assert_allclose(seen.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert (task.flags.ready, task.flags.done, task.flags.seq) == (0, 0, 1)
