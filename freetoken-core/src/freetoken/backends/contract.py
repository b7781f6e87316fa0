"""The backend contract: read this module first to write a FreeToken backend.

A backend moves one hybrid MoE layer's work between a GPU stream and the CPU
expert workers of ``freetoken-cpu-moe``. It provides one object per capability:

* :class:`GpuSync`      -- ordering between a GPU stream and the CPU workers.
* :class:`KernelIO`     -- mapped-memory publish/combine kernels (no copies).
* :class:`Staging`      -- pinned/mapped host buffers and registered expert banks.
* :class:`GraphCapture` -- capture/replay of decode steps per batch size.
* :class:`Backend`      -- name, API version, priority, ``probe()``, capabilities
  and the factories for the four objects above.

The hand-off itself happens on a :class:`HandoffTask`: one per (layer, batch-size
slot), with stable host buffers and a flag slot whose C layout lives in
``include/freetoken/handoff.h`` (mirrored by :mod:`freetoken.handoff`). The
protocol per hand-off is::

    GPU  : inputs visible in host memory, then ready = 1
    CPU  : sees ready == 1 (acquire), ready = 0, computes, writes y, done = 1 (release)
    GPU  : waits done == 1, reads y, done = 0

Streams are passed as integer handles (``torch.cuda.current_stream().cuda_stream``)
and buffers as torch tensors; native code only ever sees raw addresses, so a
backend's extension never links libtorch.

A backend is published through the ``freetoken.backends`` entry point group; the
entry point names a module or object implementing the pluggy hook
``freetoken_backend()`` (see :mod:`freetoken.backends.hookspecs`) which returns the
:class:`Backend` subclass.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import enum
from typing import Any, Callable, ClassVar, Optional

from freetoken import handoff

#: Version of this contract. A backend declares the version it implements in
#: ``Backend.api_version``; the registry refuses a backend whose value differs.
BACKEND_API_VERSION = 1


class SyncMode(str, enum.Enum):
    """How a :class:`GpuSync` orders a stream against the CPU workers."""

    STREAM_MEMOPS = "stream_memops"
    """``cuStreamWriteValue64``/``cuStreamWaitValue64`` (graph-capturable)."""
    EVENT_MEMOPS = "event_memops"
    """System-release event between the copies and the ready write (ROCm)."""
    HOST_CALLBACK = "host_callback"
    """``cudaLaunchHostFunc`` submit and wait (eager only)."""
    FLAG_WAIT_KERNEL = "flag_wait_kernel"
    """A GPU kernel spinning on the flag (when memops are missing)."""
    SYNCHRONOUS = "synchronous"
    """No GPU: the CPU backend runs the task at publish time."""


class IOPath(str, enum.Enum):
    """How activations reach the CPU and results come back."""

    KERNEL_IO = "kernel_io"
    """Publish/combine kernels on mapped memory (BF16 only)."""
    COPY = "copy"
    """D2H copies + memop ready; memop wait + H2D + add (any dtype)."""
    HOST_CALLBACK = "host_callback"
    """Copies ordered by host callbacks (eager only)."""
    SYNCHRONOUS = "synchronous"
    """The CPU backend: the layer calls the CPU kernels directly."""


@dataclasses.dataclass
class ProbeResult:
    """What :meth:`Backend.probe` found: is the hardware there, and why not."""

    available: bool
    reason: str = ""
    device_name: Optional[str] = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Capabilities:
    """Capability flags a backend reports (shown by ``freetoken doctor``).

    ``None`` means "not probed / unknown"; probes fill these with real answers.
    """

    stream_memops: Optional[bool] = None
    mapped_memory: Optional[bool] = None
    graph_capture: Optional[bool] = None
    memops_in_graphs: Optional[bool] = None
    kernel_io: Optional[bool] = None
    host_callbacks: Optional[bool] = None
    flag_wait_kernel: Optional[bool] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class HostBuffer:
    """Host memory that a backend allocated (pinned, and mapped when asked).

    ``tensor`` is a CPU torch view of the memory (uint8, ``nbytes`` long) and keeps
    it alive; ``device_ptr`` is the address the GPU uses (mapped memory) or 0.
    ``owner`` is whatever object frees the memory when garbage-collected.
    """

    tensor: Any
    host_ptr: int
    device_ptr: int
    nbytes: int
    mapped: bool
    owner: Any = None


@dataclasses.dataclass
class HandoffTask:
    """One (layer, batch-size slot) hand-off with stable buffers.

    All buffers are host tensors allocated through :class:`Staging` and live as long
    as the task; graphs captured over the task keep using the same addresses on
    every replay. ``desc`` is the ``ft_task_desc`` the CPU coordinator reads;
    ``flags`` the ``ft_flag_slot``. ``device_ptrs`` maps buffer names ("x", "ids",
    "w", "y", "flags") to the GPU-visible address of mapped memory (empty when the
    backend has no mapped memory).
    """

    layer: int
    slot: int
    max_tokens: int
    top_k: int
    hidden: int
    act_dtype: Any  # torch.dtype of x
    out_dtype: Any  # torch.dtype of y
    x: Any
    ids: Any
    w: Any
    y: Any
    flag_buffer: HostBuffer
    desc_buffer: HostBuffer
    device_ptrs: dict[str, int] = dataclasses.field(default_factory=dict)
    keepalive: list[Any] = dataclasses.field(default_factory=list)

    @property
    def flags(self) -> handoff.FlagSlot:
        return handoff.FlagSlot.from_address(self.flag_buffer.host_ptr)

    @property
    def desc(self) -> handoff.TaskDesc:
        return handoff.TaskDesc.from_address(self.desc_buffer.host_ptr)

    @property
    def flag_addr(self) -> int:
        return self.flag_buffer.host_ptr

    def check_error(self) -> None:
        """Raise if the CPU side reported an error on this slot (and clear it)."""
        err = self.flags.err
        if err:
            self.flags.err = 0
            try:
                what = handoff.Err(err).name
            except ValueError:
                what = f"code {err}"
            raise HandoffError(
                f"CPU side of MoE hand-off failed for layer {self.layer} slot {self.slot}: {what}"
            )


class HandoffError(RuntimeError):
    """The CPU side of a hand-off reported an error (watchdog, bad task, exception)."""


class BackendError(RuntimeError):
    """A backend could not be found, loaded, probed or selected."""


# --------------------------------------------------------------------------------------
# Capabilities
# --------------------------------------------------------------------------------------


class GpuSync(abc.ABC):
    """Ordering between one GPU stream and the CPU workers, on a task's flag slot.

    Both methods only *enqueue* work on ``stream``; neither blocks the host (except
    in :attr:`SyncMode.SYNCHRONOUS`). Both must be capturable into a graph unless
    :attr:`graph_safe` is False.
    """

    mode: ClassVar[SyncMode]
    graph_safe: ClassVar[bool] = True

    @abc.abstractmethod
    def publish(self, stream: int, task: HandoffTask) -> None:
        """Raise ``ready`` on ``task`` after everything enqueued before it.

        Guarantee: every kernel and copy enqueued on ``stream`` before this call has
        completed and its writes to host memory are visible to a CPU thread that
        reads ``ready == 1`` with acquire ordering.
        """

    @abc.abstractmethod
    def wait(self, stream: int, task: HandoffTask) -> None:
        """Hold later work on ``stream`` until the CPU set ``done``, then reset it.

        Guarantee: work enqueued on ``stream`` after this call starts only after the
        CPU release-stored ``done == 1``, so it observes every write the CPU made to
        ``task.y`` before that store; ``done`` is back to 0 before the next hand-off
        on the same slot can be published.
        """


class KernelIO(abc.ABC):
    """Mapped-memory publish/combine kernels: no copies, no events.

    BF16 activations only; other dtypes use the copy path.
    """

    @abc.abstractmethod
    def publish(self, stream: int, task: HandoffTask, x: Any, cpu_ids: Any, weights: Any) -> None:
        """Store ``x``, ``cpu_ids`` (-1 = GPU route) and ``weights`` into the task's
        mapped buffers, fence at system scope, then raise ``ready``.

        Guarantee: the CPU reading ``ready == 1`` (acquire) sees all stored values.
        When no route of the batch goes to the CPU the kernel completes the task
        itself (``done`` semantics satisfied) without waking the CPU.
        """

    @abc.abstractmethod
    def combine(self, stream: int, task: HandoffTask, out: Any) -> None:
        """Wait for ``done``, then ``out += y_cpu`` (read from mapped memory), reset.

        Guarantee: the add reads ``y`` only after observing ``done == 1``; later work
        on ``stream`` sees the combined ``out``.
        """

    @abc.abstractmethod
    def probe(self) -> bool:
        """Exercise publish/combine on random data, eager and captured; True if exact."""


class Staging(abc.ABC):
    """Host memory the GPU can reach, and the expert-cache fetches that use it."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        """Allocate page-locked host memory (mapped into the GPU's space if asked).

        Guarantee: the memory stays valid while the returned buffer (or its
        ``tensor``) is alive; device_ptr is valid for kernels on any stream.
        """

    @abc.abstractmethod
    def register_host(self, tensor: Any) -> Any:
        """Lock an existing host tensor (an expert bank) and register it with the
        driver so H2D copies from it run at full speed. Returns a handle whose
        lifetime bounds the registration; the tensor must outlive it."""

    @abc.abstractmethod
    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        """Enqueue an H2D copy of ``src`` (registered host) into ``dst`` (device).

        Guarantee: work enqueued on ``stream`` after this call sees ``dst`` filled.
        """

    def new_task(
        self,
        layer: int,
        slot: int,
        max_tokens: int,
        top_k: int,
        hidden: int,
        act_dtype: Any,
        out_dtype: Any,
        bank_addr: int = 0,
        mapped: bool = True,
    ) -> HandoffTask:
        """Allocate the stable buffers and descriptors of one hand-off task."""
        from freetoken.moe.task import allocate_task

        return allocate_task(
            self, layer, slot, max_tokens, top_k, hidden, act_dtype, out_dtype, bank_addr, mapped
        )


class CapturedGraph(abc.ABC):
    """One captured decode step for one batch size."""

    @abc.abstractmethod
    def replay(self, stream: Optional[int] = None) -> None:
        """Launch the captured work; same ordering as running it eagerly."""


class GraphCapture(abc.ABC):
    """Capture and replay of decode steps per batch size."""

    @abc.abstractmethod
    def capture(self, fn: Callable[[], Any], stream: Optional[int] = None) -> CapturedGraph:
        """Run ``fn`` under stream capture and return the graph.

        Guarantee: GpuSync/KernelIO operations enqueued by ``fn`` are present in the
        graph (natively or as explicit nodes), and the flag slots are not written
        during capture.
        """

    def memops_captured_natively(self) -> Optional[bool]:
        """Whether stream capture records memops as graph nodes (None: unknown)."""
        return None


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------


class Backend(abc.ABC):
    """A FreeToken backend: identity, probe, capabilities and factories.

    Class attributes a plugin sets:

    * ``name``        -- what ``--backend``/``FREETOKEN_BACKEND`` select by.
    * ``api_version`` -- must equal :data:`BACKEND_API_VERSION`.
    * ``priority``    -- breaks ties when several plugins claim the same hardware;
      higher wins.
    * ``hardware``    -- "cuda", "rocm" or "cpu": which automatic rule picks it.
    """

    name: ClassVar[str]
    api_version: ClassVar[int] = BACKEND_API_VERSION
    priority: ClassVar[int] = 0
    hardware: ClassVar[str] = "cpu"

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> ProbeResult:
        """Is the hardware this backend drives present and usable? Never raises
        for absent hardware: returns ``available=False`` with the reason."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Run the capability probes (memops, mapped memory, graph capture...)."""

    @abc.abstractmethod
    def device(self) -> Any:
        """The ``torch.device`` the dense part of a model runs on."""

    @abc.abstractmethod
    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        """A GpuSync in ``mode`` (default: the best the device supports)."""

    @abc.abstractmethod
    def staging(self) -> Staging:
        """The backend's Staging."""

    def kernel_io(self) -> Optional[KernelIO]:
        """The KernelIO, or None when the backend has none."""
        return None

    def graph_capture(self) -> Optional[GraphCapture]:
        """The GraphCapture, or None when graphs are not supported."""
        return None

    def current_stream(self) -> int:
        """Handle of the current stream of :meth:`device` (0 when there is none)."""
        return 0

    def synchronize(self) -> None:
        """Block the host until all work on the device is complete."""

    def stream_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a graph now (False without graphs).

        Work recorded while this is True is not executed until replay, so host-side
        writes (e.g. a task's ``num_tokens``) must not depend on it."""
        return False


def flag_slot_at(address: int) -> handoff.FlagSlot:
    """A ctypes view of the flag slot at a host address."""
    return handoff.FlagSlot.from_address(address)


def c_address(obj: ctypes.Structure) -> int:
    """Address of a ctypes structure."""
    return ctypes.addressof(obj)
