"""The fakegpu backend: the FreeToken contract on simulated streams."""

from __future__ import annotations

import os
import time
import types
from typing import Any, Optional

import torch

from freetoken.backends.contract import Backend, Capabilities, ModelSession, ProbeResult
from freetoken.backends.handoff_io import GpuSync, HandoffError, HandoffTask, HostBuffer, Staging, SyncMode
from freetoken.backends.options import EngineOptions
from freetoken_fakegpu.stream import FakeStream, stream_for

#: Set to make the probe report the (simulated) hardware absent.
ABSENT_ENV = "FREETOKEN_FAKEGPU_ABSENT"

#: How long a stream waits for ``done`` before it fails (the simulated watchdog).
WAIT_TIMEOUT_S = 10.0


class FakeStreamSync(GpuSync):
    """Stream-ordered flag writes and waits, like stream memops on a real GPU.

    ``publish`` enqueues ``ready = 1`` behind everything already on the stream, so
    the CPU sees ``ready`` only after those operations ran. ``wait`` enqueues a
    spin on ``done == 1`` followed by ``done = 0``, so later operations run only
    after the CPU finished.
    """

    mode = SyncMode.STREAM_MEMOPS
    graph_safe = False  # fakegpu has no graphs

    def publish(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags

        def raise_ready() -> None:
            flags.ready = 1

        stream_for(stream).enqueue(raise_ready)

    def wait(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags
        layer, slot = task.layer, task.slot

        def wait_done() -> None:
            deadline = time.monotonic() + WAIT_TIMEOUT_S
            while not flags.done:
                if time.monotonic() > deadline:
                    raise HandoffError(f"layer {layer} slot {slot}: done not set within {WAIT_TIMEOUT_S} s")
                time.sleep(0)
            flags.done = 0

        fake = stream_for(stream)
        fake.enqueue(wait_done)
        # The fake device's "kernels" are host torch ops that run at once: work after a wait
        # must not start before it, so the host waits here for the stream to drain.
        fake.synchronize()


class FakeStaging(Staging):
    """Host memory; "mapped" memory is the same address, as the device shares it."""

    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        if nbytes < 1:
            raise ValueError(f"alloc_host needs a positive size, got {nbytes}")
        raw = torch.zeros(nbytes + 128, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % 128
        tensor = raw[skip : skip + nbytes]
        ptr = tensor.data_ptr()
        return HostBuffer(tensor=tensor, host_ptr=ptr, device_ptr=ptr if mapped else 0, nbytes=nbytes, mapped=mapped)

    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        # nothing to register with a simulated driver; the handle keeps the tensor alive and,
        # mapped, gives the address kernels read it at (host memory is this device's memory)
        return types.SimpleNamespace(tensor=tensor, device_ptr=tensor.data_ptr() if mapped else 0)

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        stream_for(stream).enqueue(lambda: dst.copy_(src))


class FakeGpuBackend(Backend):
    """A simulated GPU, selected by name only (``hardware`` matches no automatic rule)."""

    name = "fakegpu"
    priority = 0
    hardware = "fakegpu"

    def __init__(self) -> None:
        self._stream = FakeStream()

    @classmethod
    def probe(cls) -> ProbeResult:
        if os.environ.get(ABSENT_ENV):
            return ProbeResult(available=False, reason=f"{ABSENT_ENV} is set: the simulated GPU is switched off")
        return ProbeResult(available=True, reason="simulated", device_name="fakegpu (host threads)")

    def capabilities(self) -> Capabilities:
        return Capabilities(
            stream_memops=True,
            mapped_memory=True,
            graph_capture=False,
            memops_in_graphs=False,
            kernel_io=False,
            host_callbacks=False,
            flag_wait_kernel=False,
            extra={"simulated": True},
        )

    def device(self) -> Any:
        return torch.device("cpu")

    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        if mode not in (None, SyncMode.STREAM_MEMOPS):
            raise ValueError(f"fakegpu supports only {SyncMode.STREAM_MEMOPS.value!r}, not {mode}")
        return FakeStreamSync()

    def staging(self) -> Staging:
        return FakeStaging()

    def current_stream(self) -> int:
        return self._stream.handle

    def synchronize(self) -> None:
        self._stream.synchronize()

    # ---- the engine seam: the generic GPU model session over these primitives ----
    def cpu_experts(self) -> Any:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()

    def open_model(self, options: EngineOptions) -> ModelSession:
        from freetoken.moe.session.gpu_session import GpuModelSession

        return GpuModelSession(self, options, self.cpu_experts())
