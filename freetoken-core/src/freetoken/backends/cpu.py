"""The built-in ``cpu`` backend: the contract on a machine without a GPU.

There is no stream to order against, so the hand-off is synchronous: the "stream"
is the calling thread. :class:`SynchronousSync` raises ``ready`` and (when it was
given one) runs the CPU side of the task right there; ``wait`` blocks the caller
until ``done`` is set, with a watchdog bound, and raises on an error. Host memory
is ordinary (page-aligned, optionally ``mlock``-ed) memory; there is no mapped
memory, no KernelIO and no graph capture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any, Callable, Optional

from freetoken import handoff
from freetoken.backends.contract import (
    Backend,
    Capabilities,
    GpuSync,
    HandoffError,
    HandoffTask,
    HostBuffer,
    ProbeResult,
    Staging,
    SyncMode,
)
from freetoken.backends.hookspecs import hookimpl
from freetoken.backends.selection import BUILTIN_PRIORITY

log = logging.getLogger(__name__)

#: Alignment of every host buffer (two cache lines; flag slots get their own line).
HOST_ALIGNMENT = 128

#: How long :meth:`SynchronousSync.wait` waits for ``done`` before it gives up.
DEFAULT_WAIT_TIMEOUT_S = 30.0


def _aligned_bytes(nbytes: int, alignment: int = HOST_ALIGNMENT) -> Any:
    """A zeroed uint8 CPU tensor of ``nbytes`` whose data starts on ``alignment``."""
    import torch

    raw = torch.zeros(nbytes + alignment, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip : skip + nbytes]


class SynchronousSync(GpuSync):
    """Hand-off on the calling thread.

    ``publish`` sets ``ready = 1`` and, if this object has a ``serve`` callable
    (the CPU side, e.g. freetoken-cpu-moe's coordinator serving one task), calls it
    inline; ``serve`` follows the protocol (clears ``ready``, writes ``y``,
    release-stores ``done = 1``). Without one, another thread serves the task.
    ``wait`` returns once ``done == 1`` and resets it.

    Ordering: everything the caller wrote before ``publish`` is visible to the
    server (same thread, or the server's acquire of ``ready``); everything the
    server wrote before ``done`` is visible after ``wait`` returns.
    """

    mode = SyncMode.SYNCHRONOUS
    graph_safe = False

    def __init__(
        self, serve: Optional[Callable[[HandoffTask], None]] = None, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    ) -> None:
        self.serve = serve
        self.timeout_s = timeout_s

    def publish(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags
        if flags.ready or flags.done:
            raise HandoffError(
                f"layer {task.layer} slot {task.slot}: publish while the previous hand-off is unfinished "
                f"(ready={flags.ready} done={flags.done}); every publish needs its wait"
            )
        flags.ready = 1
        if self.serve is not None:
            self.serve(task)

    def wait(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not flags.done:
            spins += 1
            if spins > 1000:
                if time.monotonic() > deadline:
                    raise HandoffError(
                        f"layer {task.layer} slot {task.slot}: CPU side did not finish within "
                        f"{self.timeout_s:g} s (ready={flags.ready}); is a CPU worker serving this task?"
                    )
                time.sleep(0)
        flags.done = 0
        task.check_error()


class _MlockHandle:
    """A host range locked with ``mlock`` for as long as this handle lives."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.locked = False
        self.reason = ""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._libc = libc
        if libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes)) == 0:
            self.locked = True
        else:
            errno = ctypes.get_errno()
            self.reason = f"mlock failed: errno {errno} (raise RLIMIT_MEMLOCK, e.g. `ulimit -l unlimited`)"
            log.warning("could not lock %d bytes of host expert memory: %s", self.nbytes, self.reason)

    def close(self) -> None:
        if self.locked:
            self._libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
            self.locked = False

    def __del__(self) -> None:
        self.close()


class CpuStaging(Staging):
    """Plain host memory: nothing is mapped into a device, fetches are copies."""

    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        if nbytes < 1:
            raise ValueError(f"alloc_host needs a positive size, got {nbytes}")
        tensor = _aligned_bytes(nbytes)
        # No device: `mapped` cannot be honoured; the buffer says so (mapped=False, device_ptr=0).
        return HostBuffer(tensor=tensor, host_ptr=tensor.data_ptr(), device_ptr=0, nbytes=nbytes, mapped=False)

    def register_host(self, tensor: Any) -> _MlockHandle:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous CPU tensor")
        return _MlockHandle(tensor)

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        dst.copy_(src)


class CpuBackend(Backend):
    """Runs everything on the host; the hybrid MoE layer calls the CPU kernels directly."""

    name = "cpu"
    priority = BUILTIN_PRIORITY
    hardware = "cpu"

    @classmethod
    def probe(cls) -> ProbeResult:
        import os

        return ProbeResult(available=True, reason="the CPU is always there", device_name="cpu",
                           details={"cores": os.cpu_count()})

    def capabilities(self) -> Capabilities:
        return Capabilities(
            stream_memops=False,
            mapped_memory=False,
            graph_capture=False,
            memops_in_graphs=False,
            kernel_io=False,
            host_callbacks=False,
            flag_wait_kernel=False,
            extra={"sync_modes": [SyncMode.SYNCHRONOUS.value], "flag_slot_bytes": ctypes.sizeof(handoff.FlagSlot)},
        )

    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        if mode not in (None, SyncMode.SYNCHRONOUS):
            raise ValueError(f"the cpu backend supports only {SyncMode.SYNCHRONOUS.value!r} hand-off, not {mode}")
        return SynchronousSync()

    def staging(self) -> Staging:
        return CpuStaging()


@hookimpl
def freetoken_backend() -> type[Backend]:
    return CpuBackend
