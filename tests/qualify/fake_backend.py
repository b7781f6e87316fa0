"""A fake GPU backend for CPU CI: "device" tensors live on the CPU, "mapped memory" is
plain host memory, and the CPU side is the real freetoken_cpu_moe Coordinator serving
the flag slots. Its KernelIO/GpuSync implement the ready/done protocol from Python and
consult the same fault-injection switch as the native backends; its "graph" re-runs the
recorded function on replay with capture semantics (so ``@graph`` faults apply there).
Independent of the fake plugin package (tests/plugins/freetoken-fakegpu).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, ClassVar, Optional

import torch

from freetoken import handoff
from freetoken.backends.contract import Backend, Capabilities, CapturedGraph, GraphCapture, ProbeResult
from freetoken.backends.handoff_io import GpuSync, HandoffTask, HostBuffer, KernelIO, Staging, SyncMode
from freetoken.moe.handoff import faults

TIMEOUT_S = 10.0


def _word(task: HandoffTask, field: str) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(task.flag_addr + getattr(handoff.FlagSlot, field).offset)


def _spin(word: ctypes.c_uint64, pred: Callable[[int], bool]) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        v = word.value
        if pred(v):
            return v
        if time.monotonic() > deadline:
            raise TimeoutError("fake backend: CPU side never answered")
        time.sleep(0)


class FakeStaging(Staging):
    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        t = torch.empty(nbytes + 128, dtype=torch.uint8)
        off = (-t.data_ptr()) % 128
        view = t[off : off + nbytes]
        ptr = view.data_ptr()
        return HostBuffer(view, ptr, ptr if mapped else 0, nbytes, mapped, owner=t)

    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        return tensor

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        dst.copy_(src)


class FakeSync(GpuSync):
    mode = SyncMode.STREAM_MEMOPS
    graph_safe = True

    def __init__(self, graph_safe: bool = True) -> None:
        self.graph_safe = graph_safe

    def publish(self, stream: int, task: HandoffTask) -> None:
        _word(task, "ready").value = 1

    def wait(self, stream: int, task: HandoffTask) -> None:
        done = _word(task, "done")
        _spin(done, lambda v: v != 0)
        done.value = 0


class FakeKernelIO(KernelIO):
    def __init__(self, backend: "FakeGpuBackend") -> None:
        self.backend = backend
        self.probe_details: dict = {}

    def publish(self, stream: int, task: HandoffTask, x: Any, cpu_ids: Any, weights: Any) -> None:
        kind = faults.fault_for("kernel_io", self.backend.capturing)
        if kind == "error":
            raise faults.InjectedFault("injected KernelIO publish error")
        n = x.shape[0]
        if not bool((cpu_ids >= 0).any()):
            _word(task, "done").value = 2  # empty-route skip: the CPU is not woken
            return
        if kind == "nofence":
            _word(task, "ready").value = 1
        if kind != "stale":
            task.x[:n].copy_(x)
        task.ids[:n].copy_(cpu_ids)
        task.w[:n].copy_(weights)
        if kind != "nofence":
            _word(task, "ready").value = 1

    def combine(self, stream: int, task: HandoffTask, out: Any) -> None:
        done = _word(task, "done")
        seen = _spin(done, lambda v: v != 0)
        if seen == 1 and task.flags.err == 0:
            n = out.shape[0]
            out.copy_((out.float() + task.y[:n].float()).to(out.dtype))
        done.value = 0

    def probe(self) -> bool:
        self.probe_details = {"fake": True}
        return self.backend.kio_probe_ok


class FakeGraph(CapturedGraph):
    def __init__(self, backend: "FakeGpuBackend", fn: Callable[[], Any]) -> None:
        self.backend, self.fn = backend, fn

    def replay(self, stream: Optional[int] = None) -> None:
        if self.backend.replay_raises:
            raise RuntimeError("fake graph launch failed (injected API error)")
        self.backend.capturing = True  # replays perform the work recorded at capture
        try:
            self.fn()
        finally:
            self.backend.capturing = False


class FakeGraphCapture(GraphCapture):
    def __init__(self, backend: "FakeGpuBackend") -> None:
        self.backend = backend

    def capture(self, fn: Callable[[], Any], stream: Optional[int] = None) -> CapturedGraph:
        self.backend.captures += 1
        return FakeGraph(self.backend, fn)

    def memops_captured_natively(self) -> Optional[bool]:
        return True


class FakeGpuBackend(Backend):
    name: ClassVar[str] = "fake-qualify"
    hardware: ClassVar[str] = "fake"
    priority: ClassVar[int] = 0

    def __init__(self, kernel_io: bool = True, kio_probe_ok: bool = True, graphs: bool = True) -> None:
        self.capturing = False
        self.captures = 0
        self.has_kernel_io = kernel_io
        self.kio_probe_ok = kio_probe_ok
        self.has_graphs = graphs
        self.replay_raises = False
        self._kio = FakeKernelIO(self)

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, device_name="fake")

    def capabilities(self) -> Capabilities:
        return Capabilities(stream_memops=True, mapped_memory=True, graph_capture=self.has_graphs, kernel_io=True)

    def device(self) -> Any:
        return torch.device("cpu")

    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        return FakeSync(graph_safe=mode != SyncMode.HOST_CALLBACK)

    def staging(self) -> Staging:
        return FakeStaging()

    def kernel_io(self) -> Optional[KernelIO]:
        return self._kio if self.has_kernel_io else None

    def graph_capture(self) -> Optional[GraphCapture]:
        return FakeGraphCapture(self) if self.has_graphs else None

    def stream_capturing(self, stream: int) -> bool:
        return self.capturing

    def cpu_experts(self) -> Any:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()

    def open_model(self, options: Any) -> Any:
        from freetoken.moe.session.gpu_session import GpuModelSession

        return GpuModelSession(self, options, self.cpu_experts())
