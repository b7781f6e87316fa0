"""The GpuSync modes of the native GPU backends, and which one the copy path takes.

The copy path publishes a task with D2H copies of x, ids and w followed by a ``ready``
write; the CPU must never see ``ready`` before the copied payload. How that ordering is
kept depends on the runtime:

* CUDA: the stream write (``cuStreamWriteValue64``) is ordered after the copies before
  it: :class:`MemopSync`.
* HIP: ``hipStreamWriteValue64`` does not promise that; on some RDNA stacks the CPU sees
  ``ready`` before the copied bytes. A system-release event recorded between the copies
  and the write restores the order, and recorded with ``hipEventRecordExternal`` it is a
  node of a captured graph, so every replay keeps copies -> event -> ready:
  :class:`EventMemopSync`. Without that event API a plain stream write is never used for
  the HIP copy path: eager steps take host callbacks (they run after the copies have
  completed), decode graphs the flag kernels (a system fence, then the store).

:func:`copy_sync_modes` is that policy as a function of what the device offers
(:class:`SyncFacts`), so it is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from freetoken import handoff
from freetoken.backends.contract import BackendError
from freetoken.backends.handoff_io import GpuSync, HandoffTask, SyncMode

log = logging.getLogger(__name__)

#: Bound on GPU-side waits (flag-wait and combine kernels, host-callback waits). The CPU
#: coordinator's watchdog (2 s by default) normally fires first and reports the error.
WAIT_TIMEOUT_NS = 10_000_000_000


def flags_dev(task: HandoffTask) -> int:
    """The device address of the task's mapped flag slot."""
    try:
        return task.device_ptrs["flags"]
    except KeyError:
        raise BackendError(
            f"task layer {task.layer} slot {task.slot} has no mapped flag slot; allocate it with mapped=True"
        ) from None


class MemopSync(GpuSync):
    """Stream write/wait-value on the flag slot; ``explicit_nodes`` adds them as graph
    nodes under capture where stream capture does not record them natively (CUDA:
    batch-memop nodes; HIP: flag kernels). ``graph_safe`` is False when neither works."""

    mode = SyncMode.STREAM_MEMOPS

    def __init__(self, native: Any, explicit_nodes: bool = False, graph_safe: bool = True) -> None:
        self.native = native
        self.explicit_nodes = explicit_nodes
        self.graph_safe = graph_safe  # type: ignore[misc]  # per device, not per class

    def publish(self, stream: int, task: HandoffTask) -> None:
        self.native.memop_write(stream, flags_dev(task) + handoff.FlagSlot.ready.offset, 1, self.explicit_nodes)

    def wait(self, stream: int, task: HandoffTask) -> None:
        base = flags_dev(task)
        done = base + handoff.FlagSlot.done.offset
        self.native.memop_wait(stream, done, 1, self.explicit_nodes, base + handoff.FlagSlot.err.offset)
        self.native.memop_write(stream, done, 0, self.explicit_nodes)


class EventMemopSync(MemopSync):
    """HIP's copy-path barrier: a system-release event recorded after the task's copies,
    then the memop ``ready`` write. One event per task (per flag slot), created at its
    first publish and kept by this object, which the executor holding the task keeps as
    long as any graph captured over it (replays and recaptures reuse it)."""

    mode = SyncMode.EVENT_MEMOPS

    def __init__(self, native: Any, explicit_nodes: bool = False, graph_safe: bool = True) -> None:
        super().__init__(native, explicit_nodes, graph_safe)
        self.events: dict[int, int] = {}

    def event_for(self, task: HandoffTask) -> int:
        key = task.flag_buffer.host_ptr
        event = self.events.get(key)
        if event is None:
            event = int(self.native.release_event_create())
            self.events[key] = event
        return event

    def publish(self, stream: int, task: HandoffTask) -> None:
        self.native.release_event_record(stream, self.event_for(task))
        super().publish(stream, task)

    def __del__(self) -> None:
        events, self.events = getattr(self, "events", {}), {}
        for event in events.values():
            try:
                self.native.release_event_destroy(event)
            except Exception as exc:  # noqa: BLE001 - never raise from a finalizer
                log.warning("destroying a release event failed: %s", exc)


class FlagWaitSync(GpuSync):
    """Without memops: a one-thread kernel raises ``ready`` after a system fence, and a
    one-thread kernel spins on ``done`` (bounded; on timeout it sets ``err``)."""

    mode = SyncMode.FLAG_WAIT_KERNEL
    graph_safe = True

    def __init__(self, native: Any) -> None:
        self.native = native

    def publish(self, stream: int, task: HandoffTask) -> None:
        self.native.flag_write_kernel(stream, flags_dev(task) + handoff.FlagSlot.ready.offset, 1)

    def wait(self, stream: int, task: HandoffTask) -> None:
        base = flags_dev(task)
        self.native.flag_wait_kernel(
            stream, base + handoff.FlagSlot.done.offset, 1, 0, base + handoff.FlagSlot.err.offset, WAIT_TIMEOUT_NS
        )


class HostCallbackSync(GpuSync):
    """Host functions on the stream: one raises ``ready``, one spins on ``done``. Eager only."""

    mode = SyncMode.HOST_CALLBACK
    graph_safe = False

    def __init__(self, native: Any) -> None:
        self.native = native

    def publish(self, stream: int, task: HandoffTask) -> None:
        self.native.host_callback_publish(stream, task.flag_addr)

    def wait(self, stream: int, task: HandoffTask) -> None:
        self.native.host_callback_wait(stream, task.flag_addr, WAIT_TIMEOUT_NS)


@dataclasses.dataclass(frozen=True)
class SyncFacts:
    """What a device offers the copy path's ordering (from the capability probes)."""

    memop_write_orders_copies: bool  # a memop write follows the copies before it (CUDA; not HIP)
    stream_memops: bool
    event_memops: bool  # a system-release event can be recorded, also as a captured graph node
    host_callbacks: bool
    flag_wait_kernel: bool  # mapped memory works, so the flag kernels do
    event_reason: str = ""  # why the event path is unavailable, when it is


def copy_sync_modes(facts: SyncFacts, graphs: bool) -> tuple[list[SyncMode], str]:
    """The GpuSync modes the copy path may use, best first, and why (empty: none is safe).

    ``graphs``: decode graphs are wanted (graph-capturable modes first)."""
    if facts.memop_write_orders_copies:
        if facts.stream_memops:
            return [SyncMode.STREAM_MEMOPS], "stream memops order the copies before ready"
        modes = [SyncMode.FLAG_WAIT_KERNEL] if facts.flag_wait_kernel else []
        if facts.host_callbacks and not graphs:
            modes.append(SyncMode.HOST_CALLBACK)
        return modes, "no stream memops: flag kernels"
    if facts.stream_memops and facts.event_memops:
        return [SyncMode.EVENT_MEMOPS], "HIP: a system-release event orders the copies before the memop ready write"
    why = "no stream memops" if not facts.stream_memops else f"no release event ({facts.event_reason or 'unavailable'})"
    why = f"HIP {why}: a plain memop ready write may be seen before the copied payload, so it is not used"
    eager_first = [SyncMode.HOST_CALLBACK] if facts.host_callbacks else []
    kernels = [SyncMode.FLAG_WAIT_KERNEL] if facts.flag_wait_kernel else []
    if graphs:
        modes = kernels + eager_first
        if kernels:
            return modes, f"{why}; flag kernels keep decode graphs"
        return modes, f"{why}; host callbacks are eager only"
    modes = eager_first + kernels
    if eager_first:
        return modes, f"{why}; eager steps use host callbacks"
    return modes, f"{why}; host callbacks do not run here: flag kernels"
