"""The generic native GPU backend shared by freetoken-cuda and freetoken-rocm.

Both packages build the same native surface (``freetoken/include/freetoken/gpu/``) with
their compiler and bind it here by naming their extension module; this module holds the
Python half once: probe, capabilities, Staging, KernelIO, graph capture and the factory
of the GpuSync modes (:mod:`freetoken.native_gpu.sync`, with the copy path's sync policy).
Native code sees integers only (addresses, sizes, stream handles).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import time
from typing import Any, Callable, ClassVar, Optional

from freetoken import handoff
from freetoken.backends.contract import (
    Backend,
    BackendError,
    Capabilities,
    CapturedGraph,
    CpuExperts,
    GraphCapture,
    ModelSession,
    PackedGemv,
    ProbeResult,
)
from freetoken.backends.handoff_io import GpuSync, HandoffTask, HostBuffer, KernelIO, Staging, SyncMode
from freetoken.backends.options import EngineOptions
from freetoken.moe.handoff import faults
from freetoken.native_gpu.sync import (
    WAIT_TIMEOUT_NS,
    EventMemopSync,
    FlagWaitSync,
    HostCallbackSync,
    MemopSync,
    SyncFacts,
    copy_sync_modes,
    flags_dev,
)

__all__ = ["NativeGpuBackend", "MemopSync", "EventMemopSync", "FlagWaitSync", "HostCallbackSync", "WAIT_TIMEOUT_NS"]

log = logging.getLogger(__name__)

_FAULT_CODES = {None: 0, "stale": 1, "nofence": 2}


def _load_native(module: str) -> Any:
    return importlib.import_module(module)


class _HostMemory:
    """Owns one page-locked host allocation; frees it when the last view is gone."""

    def __init__(self, native: Any, nbytes: int, mapped: bool) -> None:
        self.native = native
        self.host, self.device = native.host_alloc(nbytes, mapped)
        self.nbytes = nbytes

    def __del__(self) -> None:
        host, self.host = getattr(self, "host", 0), 0
        if host:
            try:
                self.native.host_free(host)
            except Exception as exc:  # noqa: BLE001 - never raise from a finalizer
                log.warning("freeing pinned host memory failed: %s", exc)


def _tensor_over(memory: _HostMemory) -> Any:
    """A uint8 CPU tensor over the allocation that keeps ``memory`` alive."""
    import torch

    array_type = type("_PinnedBytes", (ctypes.c_uint8 * memory.nbytes,), {})
    array = array_type.from_address(memory.host)
    array.owner = memory  # the tensor holds the array, the array holds the owner
    return torch.frombuffer(array, dtype=torch.uint8)


class _Registration:
    def __init__(self, native: Any, tensor: Any, mapped: bool, read_only: bool = False) -> None:
        self.native = native
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.device_ptr = native.host_register(tensor.data_ptr(), self.nbytes, mapped, read_only)
        self.ptr = tensor.data_ptr()

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                self.native.host_unregister(ptr)
            except Exception as exc:  # noqa: BLE001
                log.warning("unregistering host memory failed: %s", exc)


class NativeStaging(Staging):
    def __init__(self, native: Any) -> None:
        self.native = native

    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        if nbytes <= 0:
            raise ValueError(f"alloc_host: nbytes must be positive, got {nbytes}")
        memory = _HostMemory(self.native, nbytes, mapped)
        tensor = _tensor_over(memory)
        return HostBuffer(tensor, memory.host, memory.device, nbytes, mapped, owner=memory)

    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous CPU tensor")
        return _Registration(self.native, tensor, mapped=mapped, read_only=read_only)

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        _on_stream(stream, lambda: dst.copy_(src, non_blocking=True))


def _on_stream(stream: int, fn: Callable[[], Any]) -> Any:
    import torch

    if stream == torch.cuda.current_stream().cuda_stream:
        return fn()
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        return fn()


class NativeKernelIO(KernelIO):
    """Publish/combine kernels on mapped memory (BF16 activations)."""

    publishes_routes: ClassVar[bool] = True

    def __init__(self, backend: "NativeGpuBackend") -> None:
        self.backend = backend
        self.native = backend.native()
        self.probe_details: dict[str, Any] = {}
        self.faults_enabled = True  # the probe checks the path itself, without injected faults

    def publish(self, stream: int, task: HandoffTask, x: Any, cpu_ids: Any, weights: Any) -> None:
        self.publish_routes(stream, task, x, cpu_ids, weights)

    def publish_routes(
        self,
        stream: int,
        task: HandoffTask,
        x: Any,
        ids: Any,
        weights: Any,
        cpu_mask: Any = None,
        resident: Any = None,
        cpu_last_n: Optional[int] = None,
    ) -> None:
        """The contract's :meth:`~freetoken.backends.handoff_io.KernelIO.publish_routes`;
        ``ids`` int32 or int64. Keeps split kernels off the hand-off's critical path."""
        import torch

        if x.dtype != torch.bfloat16:
            raise ValueError(f"KernelIO takes bfloat16 activations, got {x.dtype}; use the copy path")
        tokens = x.shape[0]
        if tokens > task.max_tokens or x.shape[1] != task.hidden or tuple(ids.shape) != (tokens, task.top_k):
            raise ValueError(
                f"KernelIO publish: x {tuple(x.shape)} / ids {tuple(ids.shape)} do not fit task "
                f"(max_tokens={task.max_tokens}, hidden={task.hidden}, top_k={task.top_k})"
            )
        if ids.dtype not in (torch.int32, torch.int64) or weights.dtype != torch.float32:
            raise ValueError(f"KernelIO publish needs int32/int64 ids and float32 weights, got {ids.dtype}/{weights.dtype}")
        for name, t in (("x", x), ("ids", ids), ("weights", weights), ("cpu_mask", cpu_mask), ("resident", resident)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"KernelIO publish needs a contiguous {name}")
        for name, t in (("cpu_mask", cpu_mask), ("resident", resident)):
            if t is not None and t.dtype != torch.bool:
                raise ValueError(f"KernelIO publish: {name} must be bool, got {t.dtype}")
        capturing = bool(self.native.stream_is_capturing(stream))
        kind = faults.fault_for("kernel_io", capturing) if self.faults_enabled else None
        if kind == "error":
            raise faults.InjectedFault("injected KernelIO publish error")
        if not capturing:
            task.desc.num_tokens = tokens
        dp = task.device_ptrs
        self.native.kio_publish(
            stream, x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int64, weights.data_ptr(), tokens * task.hidden,
            tokens, task.top_k, 0 if cpu_mask is None else cpu_mask.data_ptr(),
            0 if resident is None else resident.data_ptr(), -1 if cpu_last_n is None else int(cpu_last_n),
            dp["x"], dp["ids"], dp["w"], flags_dev(task), _FAULT_CODES[kind],
        )  # fmt: skip

    def combine(self, stream: int, task: HandoffTask, out: Any) -> None:
        import torch

        if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape[1] != task.hidden:
            raise ValueError("KernelIO combine needs a contiguous bfloat16 [tokens, hidden] output")
        if task.out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"KernelIO combine reads y as float32 or bfloat16, task has {task.out_dtype}")
        self.native.kio_combine(
            stream, out.data_ptr(), task.device_ptrs["y"], task.out_dtype == torch.float32, out.numel(),
            flags_dev(task), WAIT_TIMEOUT_NS,
        )  # fmt: skip

    def probe(self) -> bool:
        """Round trips through publish/combine with a Python thread as the CPU side
        (y = 2 * x, exact in BF16), eager and captured, against torch."""
        from freetoken.native_gpu.kernel_io_probe import run_kernel_io_probe

        self.faults_enabled = False
        try:
            ok, details = run_kernel_io_probe(self.backend, self)
        finally:
            self.faults_enabled = True
        self.probe_details = details
        return ok


class NativeCapturedGraph(CapturedGraph):
    def __init__(self, graph: Any, keepalive: list[Any]) -> None:
        self.graph = graph
        self.keepalive = keepalive  # tasks, tensors and events used by the captured work

    def replay(self, stream: Optional[int] = None) -> None:
        if stream is None:
            self.graph.replay()
        else:
            _on_stream(stream, self.graph.replay)


class NativeGraphCapture(GraphCapture):
    def __init__(self, backend: "NativeGpuBackend") -> None:
        self.backend = backend

    def memops_captured_natively(self) -> Optional[bool]:
        probe = self.backend.graph_memop_probe()
        return bool(probe.get("native")) if probe else None

    def capture(self, fn: Callable[[], Any], stream: Optional[int] = None, keepalive: Any = ()) -> CapturedGraph:
        import torch

        graph = torch.cuda.CUDAGraph()
        kwargs = {} if stream is None else {"stream": torch.cuda.ExternalStream(stream)}
        with torch.cuda.graph(graph, **kwargs):
            result = fn()
        return NativeCapturedGraph(graph, [fn, result, *keepalive])


class NativeGpuBackend(Backend):
    """Base of the cuda/rocm backends; subclasses name their extension module."""

    native_module: ClassVar[str]
    torch_flavour: ClassVar[str]  # "cuda" or "hip": which torch build drives this GPU
    install_hint: ClassVar[str] = ""
    #: a stream memop write is ordered after the copies enqueued before it on the stream
    #: (CUDA); where not (HIP), the copy path needs a release event between them
    memop_write_orders_copies: ClassVar[bool] = True

    def __init__(self, device_index: Optional[int] = None) -> None:
        import torch

        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        self._caps: Optional[Capabilities] = None
        self._graph_probe: Optional[dict[str, Any]] = None
        self._kio: Optional[NativeKernelIO] = None
        self._event_support: Optional[dict[str, Any]] = None
        self._host_callback_error: Optional[str] = None
        self._mapped: Optional[bool] = None
        self._lock = threading.Lock()

    # ---- identity and probe -----------------------------------------------------
    @classmethod
    def native(cls) -> Any:
        try:
            return _load_native(cls.native_module)
        except ImportError as exc:
            raise BackendError(
                f"{cls.native_module} is not available ({exc}); the package was installed without its "
                f"native extension: {cls.install_hint}"
            ) from exc

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            native = cls.native()
        except BackendError as exc:
            return ProbeResult(False, reason=str(exc))
        details: dict[str, Any] = {"api": native.API}
        try:
            details["runtime_version"] = native.runtime_version()
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            details["runtime_version_error"] = str(exc)
        try:
            count = native.device_count()
        except Exception as exc:  # noqa: BLE001
            hint = cls.driver_hint()
            return ProbeResult(
                False, reason=f"no usable {cls.name} device: {hint + '; ' if hint else ''}{exc}", details=details
            )
        if count < 1:
            return ProbeResult(False, reason=f"no {cls.name} device visible", details=details)
        try:
            import torch
        except ImportError as exc:
            return ProbeResult(False, reason=f"torch is not importable: {exc}", details=details)
        flavour = getattr(torch.version, cls.torch_flavour, None)
        if not flavour:
            return ProbeResult(
                False,
                reason=f"{count} {cls.name} device(s) found but this torch build has no {cls.torch_flavour} "
                f"support (torch {torch.__version__})",
                details=details,
            )
        try:
            details["driver_version"] = native.driver_version()
            info = native.device_info(0)
        except Exception as exc:  # noqa: BLE001
            return ProbeResult(False, reason=f"{cls.name} device query failed: {exc}", details=details)
        details.update(device_count=count, device0=info)
        return ProbeResult(True, device_name=info["name"], details=details)

    @classmethod
    def driver_hint(cls) -> str:
        """A plain-words reason when the device query fails (e.g. no driver installed)."""
        return ""

    def device(self) -> Any:
        import torch

        return torch.device("cuda", self.device_index)

    def current_stream(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device_index).cuda_stream

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device_index)

    def stream_capturing(self, stream: int) -> bool:
        return bool(self.native().stream_is_capturing(stream))

    def device_memory(self) -> Optional[tuple[int, int]]:
        import torch

        free, total = torch.cuda.mem_get_info(self.device_index)
        return int(free), int(total)

    # ---- the engine seam ---------------------------------------------------------------
    def cpu_experts(self) -> CpuExperts:
        """The CPU half of hybrid layers; the cuda/rocm packages bind freetoken-cpu-moe's."""
        raise BackendError(
            f"backend {self.name} runs routed experts on the CPU through freetoken-cpu-moe, which this "
            "backend package does not provide: install freetoken-cpu-moe (see docs/install.md)"
        )

    def open_model(self, options: EngineOptions) -> ModelSession:
        from freetoken.moe.session.gpu_session import GpuModelSession

        return GpuModelSession(self, options, self.cpu_experts())

    # ---- capabilities ---------------------------------------------------------------
    def device_info(self) -> dict[str, Any]:
        return self.native().device_info(self.device_index)

    def graph_memop_probe(self) -> dict[str, Any]:
        with self._lock:
            if self._graph_probe is None:
                staging = self.staging()
                slot = staging.alloc_host(ctypes.sizeof(handoff.FlagSlot), mapped=True)
                if not self.device_info()["stream_memops"]:
                    self._graph_probe = {"native": False, "explicit_ok": False, "error": "no stream memops"}
                else:
                    self._graph_probe = dict(self.native().graph_memop_probe(slot.host_ptr, slot.device_ptr))
        return self._graph_probe

    def event_support(self) -> dict[str, Any]:
        """Can a system-release event be recorded here, eagerly and as a captured graph node
        (the HIP copy path's barrier)? ``{"compiled", "available", "reason"}``."""
        with self._lock:
            if self._event_support is None:
                self._event_support = dict(self.native().event_support())
        return self._event_support

    def host_callback_error(self) -> str:
        """'' when a host function enqueued on a stream runs here, else the error."""
        with self._lock:
            if self._host_callback_error is None:
                try:
                    self._host_callback_error = str(self.native().host_callback_probe())
                except Exception as exc:  # noqa: BLE001 - a probe answers with the reason
                    self._host_callback_error = f"{type(exc).__name__}: {exc}"
        return self._host_callback_error

    def mapped_memory(self) -> bool:
        """Mapped (on HIP: fine-grained, coherent) host memory the GPU writes and the CPU reads."""
        if self._mapped is None:
            self._mapped = bool(self.device_info()["can_map_host_memory"]) and self._mapped_memory_works()
        return self._mapped

    def sync_facts(self) -> SyncFacts:
        info = self.device_info()
        memops = bool(info["stream_memops"])
        events = self.event_support()
        return SyncFacts(
            memop_write_orders_copies=self.memop_write_orders_copies, stream_memops=memops, event_memops=memops and bool(events["available"]),
            host_callbacks=self.host_callback_error() == "", flag_wait_kernel=self.mapped_memory(),
            event_reason=str(events.get("reason", "")),
        )  # fmt: skip

    def copy_sync_modes(self, graphs: bool) -> list[SyncMode]:
        modes, reason = copy_sync_modes(self.sync_facts(), graphs)
        log.debug("copy path sync modes (graphs %s): %s (%s)", graphs, [m.value for m in modes], reason)
        return modes

    def capabilities(self) -> Capabilities:
        if self._caps is not None:
            return self._caps
        info = self.device_info()
        caps = Capabilities(extra={"device": info})
        caps.stream_memops = bool(info["stream_memops"])
        caps.mapped_memory = self.mapped_memory()
        caps.flag_wait_kernel = caps.mapped_memory
        callback_error = self.host_callback_error()
        caps.host_callbacks = callback_error == ""
        if callback_error:
            caps.extra["host_callback_error"] = callback_error
        caps.graph_capture = True
        if caps.stream_memops:
            gp = self.graph_memop_probe()
            caps.memops_in_graphs = bool(gp.get("native") or gp.get("explicit_ok"))
            caps.extra["graph_memops"] = gp
        else:
            caps.memops_in_graphs = False
        caps.extra["event_memops"] = self.event_support()
        caps.event_memops = caps.stream_memops and bool(self.event_support()["available"])
        facts = self.sync_facts()
        for graphs in (True, False):
            modes, reason = copy_sync_modes(facts, graphs)
            caps.extra[f"copy_sync_{'graphs' if graphs else 'eager'}"] = {"modes": [m.value for m in modes],
                                                                           "reason": reason}
        kio = self.kernel_io()
        caps.kernel_io = bool(kio is not None and kio.probe())
        if kio is not None:
            caps.extra["kernel_io_probe"] = kio.probe_details
        self._caps = caps
        return caps

    def _mapped_memory_works(self) -> bool:
        """Write through the device pointer of a mapped allocation and read it on the host."""
        try:
            buf = self.staging().alloc_host(64, mapped=True)
            buf.tensor.fill_(0)
            self.native().flag_write_kernel(self.current_stream(), buf.device_ptr, 0x5EED)
            self.synchronize()
            return handoff.FlagSlot.from_address(buf.host_ptr).ready == 0x5EED
        except Exception as exc:  # noqa: BLE001 - a capability probe answers False
            log.warning("mapped host memory probe failed: %s", exc)
            return False

    # ---- factories ---------------------------------------------------------------
    def staging(self) -> Staging:
        return NativeStaging(self.native())

    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        """A GpuSync in ``mode``; None: the first of :meth:`copy_sync_modes` with graphs.
        On HIP, plain STREAM_MEMOPS is refused for the copy path's ordering only by that
        default: asking for it explicitly still gives it (tests, diagnostics)."""
        info = self.device_info()
        if mode is None:
            modes = self.copy_sync_modes(graphs=True)
            if not modes:
                _, reason = copy_sync_modes(self.sync_facts(), True)
                raise BackendError(f"{self.name}: no safe way to order the copy path's hand-off here ({reason})")
            mode = modes[0]
        if mode in (SyncMode.STREAM_MEMOPS, SyncMode.EVENT_MEMOPS):
            if not info["stream_memops"]:
                raise BackendError(f"stream memops unavailable on this device: {info['stream_memops_reason']}")
            gp = self.graph_memop_probe()
            native = bool(gp.get("native", False))
            graph_safe = native or bool(gp.get("explicit_ok", False))
            if mode == SyncMode.STREAM_MEMOPS:
                return MemopSync(self.native(), explicit_nodes=not native, graph_safe=graph_safe)
            events = self.event_support()
            if not events["available"]:
                raise BackendError(f"the event-ordered copy path is unavailable: {events['reason']}")
            return EventMemopSync(self.native(), explicit_nodes=not native, graph_safe=graph_safe)
        if mode == SyncMode.FLAG_WAIT_KERNEL:
            return FlagWaitSync(self.native())
        if mode == SyncMode.HOST_CALLBACK:
            return HostCallbackSync(self.native())
        raise BackendError(f"{self.name} backend has no GpuSync mode {mode}")

    def kernel_io(self) -> Optional[KernelIO]:
        if self._kio is None:
            self._kio = NativeKernelIO(self)
        return self._kio

    def graph_capture(self) -> Optional[GraphCapture]:
        return NativeGraphCapture(self)

    def packed_gemv(self) -> Optional[PackedGemv]:
        native = self.native()
        if not hasattr(native, "packed_gemv"):
            return None  # a build without it (ROCm)
        from freetoken.native_gpu.gemv import NativePackedGemv

        return NativePackedGemv(native, self.current_stream)


def wait_for_flag(address: int, value: int, timeout_s: float) -> bool:
    """Host-side spin on a 64-bit word (used by probes standing in for the CPU side)."""
    word = ctypes.c_uint64.from_address(address)
    deadline = time.monotonic() + timeout_s
    while word.value != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0)
    return True
