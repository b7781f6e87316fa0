"""A simulated HIP runtime behind the native backend's Python half.

:class:`SimHipRuntime` has the functions and arguments of ``freetoken_rocm._C`` (the
shared GPU surface built with hipcc) and runs them on the host: "device" memory is host
memory, the stream is synchronous, and the CPU side is the real freetoken_cpu_moe
coordinator serving the flag slots. :class:`SimHipBackend` is the generic
:class:`~freetoken.native_gpu.backend.NativeGpuBackend` over it, so the probes, the
copy-path sync policy, the GpuSync classes, KernelIO and qualification that run are the
production ones.

Known HIP failures the runtime reproduces (each a constructor switch):

* ``ready_before_payload``: a memop ``ready`` write not preceded by a system-release
  event is seen by the CPU before the copied payload (it reads the previous activations).
* ``memops_capture="run_at_capture"``: stream capture runs memops while capturing and
  leaves them out of the graph; ``explicit_nodes=False``: no explicit node replaces them.
* ``event_api=False``: the build lacks hipEventRecordWithFlags.
* ``kio_stale_above``: KernelIO publishes of more than this many activations raise
  ``ready`` without storing them (0: every publish).
* ``host_callbacks=False``, ``memops=False``, ``mapped=False``: missing features.

Graph phases: while capturing, launches (kernels, event records, natively captured
memops) are recorded, i.e. not run; a replay re-runs the captured function with every
recorded launch performed, like the graph would.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from typing import Any, Callable, ClassVar, Optional

import torch

from freetoken import handoff
from freetoken.backends.contract import CapturedGraph, GraphCapture
from freetoken.backends.handoff_io import HandoffTask, Staging
from freetoken.native_gpu.backend import NativeGpuBackend, NativeStaging

READY = handoff.FlagSlot.ready.offset
DONE = handoff.FlagSlot.done.offset
ERR = handoff.FlagSlot.err.offset
WATCHDOG = 1  # FT_ERR_WATCHDOG
SPIN_TIMEOUT_S = 10.0


def _word(address: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(address)


def _view(address: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_uint8 * (count * size)).from_address(address), dtype=dtype)


def _spin(address: int, pred: Callable[[int], bool], timeout_s: float = SPIN_TIMEOUT_S) -> Optional[int]:
    deadline = time.monotonic() + timeout_s
    word = _word(address)
    while True:
        v = word.value
        if pred(v):
            return v
        if time.monotonic() > deadline:
            return None
        time.sleep(0)


class SimHipRuntime:
    """The ``freetoken_rocm._C`` surface, simulated (see the module docstring)."""

    API = "hip"
    HANDOFF_ABI_VERSION = handoff.ABI_VERSION
    RUNTIME_VERSION_COMPILED = 60400000

    def __init__(
        self,
        *,
        event_api: bool = True,
        memops: bool = True,
        memops_capture: str = "native",
        explicit_nodes: bool = True,
        host_callbacks: bool = True,
        mapped: bool = True,
        ready_before_payload: bool = True,
        kio_stale_above: Optional[int] = None,
        arch: str = "gfx1201",
    ) -> None:
        assert memops_capture in ("native", "run_at_capture")
        self.EVENT_RECORD_WITH_FLAGS = event_api
        self.memops = memops
        self.memops_capture = memops_capture
        self.explicit_nodes = explicit_nodes
        self.host_callbacks = host_callbacks
        self.mapped = mapped
        self.ready_before_payload = ready_before_payload
        self.kio_stale_above = kio_stale_above
        self.arch = arch
        self.phase = "eager"  # "capturing" | "replaying"
        self.tasks: dict[int, HandoffTask] = {}  # flag slot address -> task
        self.visible_x: dict[int, torch.Tensor] = {}  # what the CPU sees of x before the copy lands
        self.released = False  # a release event ran since the last ready write
        self.stale_reads = 0  # ready writes the CPU saw before their payload
        self.live_events: set[int] = set()
        self.events_created = 0
        self._event_ids = itertools.count(1)
        self._allocs: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ---- queries --------------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def runtime_version(self) -> int:
        return self.RUNTIME_VERSION_COMPILED

    def driver_version(self) -> int:
        return self.RUNTIME_VERSION_COMPILED

    def device_info(self, device: int) -> dict[str, Any]:
        return {
            "name": f"Simulated Radeon ({self.arch})", "arch": self.arch, "total_memory": 32 << 30,
            "multiprocessors": 64, "can_map_host_memory": self.mapped, "unified_addressing": True,
            "pageable_memory_access": False, "stream_memops": self.memops,
            "stream_memops_reason": "" if self.memops else "device reports hipDeviceAttributeCanUseStreamWaitValue = 0",
        }  # fmt: skip

    # ---- host memory ----------------------------------------------------------------
    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int]:
        buf = (ctypes.c_uint8 * (nbytes + 128))()
        ptr = ctypes.addressof(buf) + (-ctypes.addressof(buf)) % 128
        with self._lock:
            self._allocs[ptr] = buf
        return ptr, ptr if mapped and self.mapped else 0

    def host_free(self, host_ptr: int) -> None:
        with self._lock:
            self._allocs.pop(host_ptr)

    def host_register(self, ptr: int, nbytes: int, mapped: bool, read_only: bool = False) -> int:
        return ptr if mapped else 0

    def host_unregister(self, ptr: int) -> None:
        pass

    # ---- stream and graph phases -------------------------------------------------------
    def stream_is_capturing(self, stream: int) -> bool:
        return self.phase != "eager"

    def _launch(self, op: Callable[[], None]) -> None:
        """A kernel launch or event record: recorded while capturing, run eagerly and on replay."""
        if self.phase != "capturing":
            op()

    def _memop(self, op: Callable[[], None]) -> None:
        if self.phase == "eager" or self.memops_capture == "native":
            self._launch(op)
        elif self.phase == "capturing":  # run while capturing, absent from the graph
            op()

    def _store(self, address: int, value: int) -> None:
        slot = address - READY
        task = self.tasks.get(slot)
        if value == 1 and task is not None:
            n = task.desc.num_tokens
            if self.ready_before_payload and not self.released:
                # the CPU sees ready while the copied payload is still in flight: it reads what
                # the slot held before (the previous hand-off's activations, zeros at first)
                landed = task.x[:n].clone()
                task.x[:n].copy_(self.visible_x.get(slot, torch.zeros_like(landed))[:n])
                self.visible_x[slot] = landed
                self.stale_reads += 1
            else:
                self.visible_x[slot] = task.x[:n].clone()
            self.released = False
        _word(address).value = value

    def _wait(self, address: int, value: int, err_addr: int) -> None:
        if _spin(address, lambda v: v == value) is None:
            if err_addr:
                _word(err_addr).value = WATCHDOG
            raise TimeoutError(f"simulated wait on {address:#x} == {value} timed out")

    # ---- memops, explicit nodes, flag kernels -------------------------------------------
    def memop_write(self, stream: int, dev_addr: int, value: int, explicit_node: bool = False) -> None:
        if not self.memops:
            raise RuntimeError("hip call failed: hipStreamWriteValue64 -> hipErrorNotSupported")
        if explicit_node and self.phase != "eager":
            return self._explicit(lambda: self._fenced_store(dev_addr, value))
        self._memop(lambda: self._store(dev_addr, value))

    def memop_wait(
        self, stream: int, dev_addr: int, value: int, explicit_node: bool = False, err_addr: int = 0
    ) -> None:
        if not self.memops:
            raise RuntimeError("hip call failed: hipStreamWaitValue64 -> hipErrorNotSupported")
        if explicit_node and self.phase != "eager":
            return self._explicit(lambda: self._wait(dev_addr, value, err_addr))
        self._memop(lambda: self._wait(dev_addr, value, err_addr))

    def _explicit(self, op: Callable[[], None]) -> None:
        if not self.explicit_nodes:
            raise RuntimeError("explicit memop graph nodes are not available on this runtime")
        self._launch(op)

    def _fenced_store(self, address: int, value: int) -> None:
        self.released = True  # the flag kernel's system fence orders everything before it
        self._store(address, value)

    def flag_write_kernel(self, stream: int, dev_addr: int, value: int) -> None:
        self._launch(lambda: self._fenced_store(dev_addr, value))

    def flag_wait_kernel(
        self, stream: int, dev_addr: int, value: int, reset: int, err_addr: int, timeout_ns: int
    ) -> None:
        def op() -> None:
            if _spin(dev_addr, lambda v: v == value, timeout_ns / 1e9) is None and err_addr:
                _word(err_addr).value = WATCHDOG
            _word(dev_addr).value = reset

        self._launch(op)

    # ---- release events -----------------------------------------------------------------
    def event_support(self) -> dict[str, Any]:
        if not self.EVENT_RECORD_WITH_FLAGS:
            return {"compiled": False, "available": False,
                    "reason": "built without hipEventRecordWithFlags (HIP 5.2 headers): rebuild freetoken-rocm "
                              "against a ROCm that has it"}  # fmt: skip
        return {"compiled": True, "available": True, "reason": ""}

    def release_event_create(self) -> int:
        event = next(self._event_ids)
        self.live_events.add(event)
        self.events_created += 1
        return event

    def release_event_destroy(self, event: int) -> None:
        self.live_events.remove(event)

    def release_event_record(self, stream: int, event: int) -> None:
        if not self.EVENT_RECORD_WITH_FLAGS:
            raise RuntimeError("freetoken_rocm was built without hipEventRecordWithFlags (HIP 5.2)")
        if event not in self.live_events:
            raise RuntimeError(f"hip call failed: hipEventRecord -> hipErrorInvalidHandle (event {event})")
        self._launch(lambda: setattr(self, "released", True))

    # ---- host callbacks -------------------------------------------------------------------
    def host_callback_probe(self) -> str:
        return "" if self.host_callbacks else "hip call failed: hipStreamAddCallback -> hipErrorNotSupported"

    def _eager_only(self) -> None:
        if self.phase != "eager":
            raise RuntimeError("host-callback hand-off is eager only: refusing to capture it into a graph")
        if not self.host_callbacks:
            raise RuntimeError("hip call failed: hipStreamAddCallback -> hipErrorNotSupported")

    def host_callback_publish(self, stream: int, slot_host: int) -> None:
        self._eager_only()
        self.released = True  # a callback runs after the work before it has completed
        self._store(slot_host + READY, 1)

    def host_callback_wait(self, stream: int, slot_host: int, timeout_ns: int) -> None:
        self._eager_only()
        if _spin(slot_host + DONE, lambda v: v != 0, timeout_ns / 1e9) is None:
            _word(slot_host + ERR).value = WATCHDOG
        _word(slot_host + DONE).value = 0

    # ---- KernelIO ---------------------------------------------------------------------------
    def kio_publish(self, stream: int, x: int, ids: int, ids_are_64: bool, w: int, n_x: int, tokens: int, top_k: int,
                    cpu_mask: int, resident: int, cpu_last_n: int, dst_x: int, dst_ids: int, dst_w: int,
                    flags: int, fault: int = 0) -> None:  # fmt: skip
        def op() -> None:
            n = tokens * top_k
            idv = _view(ids, n, torch.int64 if ids_are_64 else torch.int32).to(torch.int32)
            if cpu_mask:
                cpu = _view(cpu_mask, n, torch.bool).clone()
            elif cpu_last_n >= 0:
                cpu = (torch.arange(n) % top_k) >= top_k - cpu_last_n
            elif resident:
                res = _view(resident, int(idv.max().clamp(min=0)) + 1, torch.bool)
                cpu = ~res[idv.clamp(min=0).long()]
            else:
                cpu = torch.ones(n, dtype=torch.bool)
            cpu &= idv >= 0
            stale = fault != 0 or (self.kio_stale_above is not None and n_x > self.kio_stale_above)
            if not stale:
                _view(dst_x, n_x, torch.int16).copy_(_view(x, n_x, torch.int16))
            _view(dst_ids, n, torch.int32).copy_(torch.where(cpu, idv, torch.full_like(idv, -1)))
            _view(dst_w, n, torch.float32).copy_(_view(w, n, torch.float32))
            if bool(cpu.any()):
                _word(flags + READY).value = 1
            else:
                _word(flags + DONE).value = 2  # the empty-route skip

        self._launch(op)

    def kio_combine(self, stream: int, out: int, y: int, y_is_f32: bool, n: int, flags: int, timeout_ns: int) -> None:
        def op() -> None:
            seen = _spin(flags + DONE, lambda v: v != 0, timeout_ns / 1e9)
            _word(flags + DONE).value = 0
            if seen is None:
                _word(flags + ERR).value = WATCHDOG
            elif seen == 1 and _word(flags + ERR).value == 0:
                o = _view(out, n, torch.bfloat16)
                yv = _view(y, n, torch.float32 if y_is_f32 else torch.bfloat16)
                o.copy_((o.float() + yv.float()).to(torch.bfloat16))

        self._launch(op)

    # ---- does capture record memops? (the native probe's steps, on this runtime) ------------
    def graph_memop_probe(self, host_addr: int, dev_addr: int) -> dict[str, Any]:
        word = _word(host_addr)
        r: dict[str, Any] = {"capture_ok": False, "flag_unchanged_during_capture": False, "nodes": 0,
                             "memop_nodes": 0, "replay_performed": False, "native": False, "explicit_ok": False,
                             "error": "", "explicit_error": ""}  # fmt: skip

        def run(explicit: bool, phase: str) -> None:
            self.phase = phase
            try:
                self.memop_write(0, dev_addr, 7, explicit)
                self.memop_wait(0, dev_addr, 7, explicit)
                self.memop_write(0, dev_addr, 9, explicit)
            finally:
                self.phase = "eager"

        for explicit in (False, True):
            try:
                word.value = 0
                run(explicit, "capturing")
                unchanged = word.value == 0
                word.value = 0
                run(explicit, "replaying")
                ok = unchanged and word.value == 9
                if explicit:
                    r["explicit_ok"] = ok
                else:
                    r.update(capture_ok=True, flag_unchanged_during_capture=unchanged, nodes=3, memop_nodes=3,
                             replay_performed=word.value == 9, native=ok)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the probe reports, as the native one does
                r["explicit_error" if explicit else "error"] = str(exc)
        word.value = 0
        return r


class SimGraph(CapturedGraph):
    def __init__(self, runtime: SimHipRuntime, fn: Callable[[], Any], keepalive: Any) -> None:
        self.runtime, self.fn, self.keepalive = runtime, fn, keepalive

    def replay(self, stream: Optional[int] = None) -> None:
        self.runtime.phase = "replaying"
        try:
            self.fn()
        finally:
            self.runtime.phase = "eager"


class SimGraphCapture(GraphCapture):
    def __init__(self, runtime: SimHipRuntime) -> None:
        self.runtime = runtime
        self.captures = 0

    def capture(self, fn: Callable[[], Any], stream: Optional[int] = None, keepalive: Any = ()) -> CapturedGraph:
        self.captures += 1
        self.runtime.phase = "capturing"
        try:
            result = fn()
        finally:
            self.runtime.phase = "eager"
        return SimGraph(self.runtime, fn, [result, *keepalive])


class SimStaging(NativeStaging):
    """NativeStaging over the simulated runtime; tasks are made known to it (it needs
    their payload to show the CPU a stale one)."""

    def __init__(self, runtime: SimHipRuntime) -> None:
        super().__init__(runtime)
        self.runtime = runtime

    def new_task(self, *args: Any, **kwargs: Any) -> HandoffTask:
        task = super().new_task(*args, **kwargs)
        if "flags" in task.device_ptrs:
            self.runtime.tasks[task.device_ptrs["flags"]] = task
        return task

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        dst.copy_(src)


class SimHipBackend(NativeGpuBackend):
    """The production native backend over :class:`SimHipRuntime` (host "device", one stream)."""

    name: ClassVar[str] = "sim-rocm"
    hardware: ClassVar[str] = "sim-rocm"
    native_module: ClassVar[str] = "sim_hip"
    torch_flavour: ClassVar[str] = "hip"
    memop_write_orders_copies: ClassVar[bool] = False

    def __init__(self, runtime: Optional[SimHipRuntime] = None) -> None:
        self.runtime = runtime or SimHipRuntime()
        self._capture = SimGraphCapture(self.runtime)
        super().__init__(device_index=0)

    def native(self) -> Any:  # type: ignore[override]
        return self.runtime

    def device(self) -> Any:
        return torch.device("cpu")

    def current_stream(self) -> int:
        return 1

    def synchronize(self) -> None:
        pass

    def device_memory(self) -> Optional[tuple[int, int]]:
        return None

    def staging(self) -> Staging:
        return SimStaging(self.runtime)

    def graph_capture(self) -> Optional[GraphCapture]:
        return self._capture

    def cpu_experts(self) -> Any:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()
