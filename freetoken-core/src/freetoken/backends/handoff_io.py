"""The hand-off primitives: how one MoE layer's CPU routes leave a GPU stream and come back.

* :class:`HandoffTask` -- the stable host buffers and flag slot of one (layer, batch-size
  slot); its C layout (flag slot, task descriptor) lives in ``include/freetoken/handoff.h``,
  mirrored by :mod:`freetoken.handoff`; :func:`allocate_task` carves it out of memory that
  :class:`Staging` provides.
* :class:`GpuSync` -- the ordering between a stream and the CPU workers on a task's flag slot
  (:class:`SyncMode` says how).
* :class:`KernelIO` -- publish/combine kernels on mapped memory; the other :class:`IOPath` values
  copy.
* :class:`Staging` -- page-locked (and mapped) host memory, registered expert banks, fetches.

The protocol per hand-off::

    GPU  : inputs visible in host memory, then ready = 1
    CPU  : sees ready == 1 (acquire), ready = 0, computes, writes y, done = 1 (release)
    GPU  : waits done == 1, reads y, done = 0

A backend provides these through :class:`freetoken.backends.contract.Backend`.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import enum
import types
from typing import Any, ClassVar, Mapping, Optional

from freetoken import handoff

_ALIGN = 128


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


def _dtype_fmt(dtype: Any) -> int:
    import torch

    table = {torch.float32: handoff.Fmt.F32, torch.float16: handoff.Fmt.F16, torch.bfloat16: handoff.Fmt.BF16}
    try:
        return int(table[dtype])
    except KeyError:
        raise ValueError(f"unsupported activation dtype {dtype}; use float32, float16 or bfloat16") from None


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def allocate_task(
    staging: "Staging",
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
    """Carve x/ids/w/y, the flag slot and the descriptor out of host buffers.

    x/ids/w/y share one buffer (one registration, one mapping); the flag slot and
    the descriptor get their own so that a flag slot never shares a cache line with
    data the GPU streams into.
    """
    import torch

    if max_tokens < 1 or top_k < 1 or hidden < 1:
        raise ValueError(f"bad task shape: max_tokens={max_tokens} top_k={top_k} hidden={hidden}")
    act_size = torch.empty((), dtype=act_dtype).element_size()
    out_size = torch.empty((), dtype=out_dtype).element_size()
    sizes = {
        "x": _round_up(max_tokens * hidden * act_size),
        "ids": _round_up(max_tokens * top_k * 4),
        "w": _round_up(max_tokens * top_k * 4),
        "y": _round_up(max_tokens * hidden * out_size),
    }
    data = staging.alloc_host(sum(sizes.values()), mapped=mapped)
    flags = staging.alloc_host(_round_up(ctypes.sizeof(handoff.FlagSlot)), mapped=mapped)
    descb = staging.alloc_host(_round_up(ctypes.sizeof(handoff.TaskDesc)), mapped=False)

    offs: dict[str, int] = {}
    off = 0
    for name, n in sizes.items():
        offs[name] = off
        off += n
    raw = data.tensor
    x = raw[offs["x"] : offs["x"] + max_tokens * hidden * act_size].view(act_dtype).view(max_tokens, hidden)
    ids = raw[offs["ids"] : offs["ids"] + max_tokens * top_k * 4].view(torch.int32).view(max_tokens, top_k)
    w = raw[offs["w"] : offs["w"] + max_tokens * top_k * 4].view(torch.float32).view(max_tokens, top_k)
    y = raw[offs["y"] : offs["y"] + max_tokens * hidden * out_size].view(out_dtype).view(max_tokens, hidden)
    ctypes.memset(flags.host_ptr, 0, ctypes.sizeof(handoff.FlagSlot))
    ids.fill_(-1)

    device_ptrs: dict[str, int] = {}
    if data.mapped and data.device_ptr:
        device_ptrs = {k: data.device_ptr + offs[k] for k in sizes}
    if flags.mapped and flags.device_ptr:
        device_ptrs["flags"] = flags.device_ptr

    desc = handoff.TaskDesc.from_address(descb.host_ptr)
    ctypes.memset(descb.host_ptr, 0, ctypes.sizeof(handoff.TaskDesc))
    desc.abi_version = handoff.ABI_VERSION
    desc.layer = layer
    desc.slot = slot
    desc.max_tokens = max_tokens
    desc.num_tokens = max_tokens
    desc.top_k = top_k
    desc.hidden = hidden
    desc.act_dtype = _dtype_fmt(act_dtype)
    desc.out_dtype = _dtype_fmt(out_dtype)
    desc.x = data.host_ptr + offs["x"]
    desc.ids = data.host_ptr + offs["ids"]
    desc.w = data.host_ptr + offs["w"]
    desc.y = data.host_ptr + offs["y"]
    desc.flag_slot = flags.host_ptr
    desc.bank = bank_addr

    return HandoffTask(
        layer=layer,
        slot=slot,
        max_tokens=max_tokens,
        top_k=top_k,
        hidden=hidden,
        act_dtype=act_dtype,
        out_dtype=out_dtype,
        x=x,
        ids=ids,
        w=w,
        y=y,
        flag_buffer=flags,
        desc_buffer=descb,
        device_ptrs=device_ptrs,
        keepalive=[data],
    )


class SyncMode(str, enum.Enum):
    """How a :class:`GpuSync` orders a stream against the CPU workers."""

    STREAM_MEMOPS = "stream_memops"
    """``cuStreamWriteValue64``/``cuStreamWaitValue64`` (graph-capturable)."""
    EVENT_MEMOPS = "event_memops"
    """HIP: a system-release event recorded between the copies and the memop ready write
    (as an external event-record node under capture, so graph replays keep the order)."""
    HOST_CALLBACK = "host_callback"
    """Host functions on the stream (``cudaLaunchHostFunc``/``hipStreamAddCallback``) submit
    and wait (eager only)."""
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

    #: :meth:`publish_routes` is offered: the GPU/CPU split of the routes is done inside the
    #: publish kernel (nothing between the router and the hand-off)
    publishes_routes: ClassVar[bool] = False
    #: what the last :meth:`probe` found, shown when it failed
    probe_details: Mapping[str, Any] = types.MappingProxyType({})

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

    def publish_routes(self, stream: int, task: HandoffTask, x: Any, ids: Any, weights: Any, cpu_mask: Any = None,
                       resident: Any = None, cpu_last_n: Optional[int] = None) -> None:
        """:meth:`publish` with the split done in the kernel (where :attr:`publishes_routes`):
        route (t, k) goes to the CPU when ``cpu_mask[t, k]`` (bool), else when k is among the
        last ``cpu_last_n``, else when ``resident[ids[t, k]]`` is False, else (nothing given)
        when ``ids >= 0``."""
        raise NotImplementedError(f"{type(self).__name__} publishes split routes only (publish)")

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
    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        """Lock an existing host tensor (an expert bank) and register it with the
        driver so H2D copies from it run at full speed. ``mapped``: kernels may also read
        it in place (the handle's ``device_ptr`` is its device address); ``read_only``:
        the memory is a read-only mapping (a model file). Returns a handle whose lifetime
        bounds the registration (raises if the driver refuses); the tensor must outlive it."""

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
        return allocate_task(
            self, layer, slot, max_tokens, top_k, hidden, act_dtype, out_dtype, bank_addr, mapped
        )



def flag_slot_at(address: int) -> handoff.FlagSlot:
    """A ctypes view of the flag slot at a host address."""
    return handoff.FlagSlot.from_address(address)



def c_address(obj: ctypes.Structure) -> int:
    """Address of a ctypes structure."""
    return ctypes.addressof(obj)

