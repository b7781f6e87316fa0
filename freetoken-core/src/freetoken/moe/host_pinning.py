"""Page-locking the host expert banks and registering them with the GPU driver.

Copies from pageable memory go through the driver's staging buffers at a fraction of the
PCIe bandwidth and block the calling thread; from registered memory they are DMA at full
speed and asynchronous. The banks are the checkpoint's bytes (a read-only file mapping for
GGUF files), so they are registered read-only. Registration locks the pages in RAM for the
process's lifetime: what it costs is RAM that the page cache can no longer reclaim.

:func:`lock_limit` reports whether the OS lets this process lock memory (RLIMIT_MEMLOCK;
the driver's registration pins pages itself, but a low limit usually means a container or
a user policy that also refuses it), for ``freetoken doctor``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Optional

import torch

log = logging.getLogger(__name__)

#: cudaHostRegister flags (hipHostRegister uses the same values)
REGISTER_PORTABLE, REGISTER_MAPPED, REGISTER_READ_ONLY = 1, 2, 8


@dataclasses.dataclass
class LockLimit:
    soft: Optional[int]  # bytes, None = unlimited
    hard: Optional[int]
    can_lock: bool
    reason: str


def lock_limit(need: int = 0) -> LockLimit:
    """RLIMIT_MEMLOCK of this process, and whether ``need`` bytes can be locked under it."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return LockLimit(None, None, False, "no RLIMIT_MEMLOCK on this OS")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    s, h = (None if v == inf else int(v) for v in (soft, hard))
    if s is None:
        return LockLimit(s, h, True, "RLIMIT_MEMLOCK unlimited")
    if need and s < need:
        return LockLimit(s, h, False, f"RLIMIT_MEMLOCK is {s >> 20} MiB, below the {need >> 20} MiB of expert banks "
                                      "(raise it: `ulimit -l unlimited`, or memlock in /etc/security/limits.conf "
                                      "or the container's --ulimit memlock=-1)")
    return LockLimit(s, h, True, f"RLIMIT_MEMLOCK {s >> 20} MiB")


def _address_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class HostRegistration:
    """Host ranges registered with the driver; :meth:`close` unregisters them."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # (start, size)
        self.bytes = 0
        self.seconds = 0.0
        self.keep: list[Any] = []  # the tensors whose memory is registered (kept alive)

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register the memory of ``tensors`` (CPU, contiguous), merged into page ranges.
        Raises RuntimeError naming the driver's error if a range cannot be registered."""
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA/HIP device: nothing to register host memory with")
        spans = sorted(_address_range(t) for t in tensors if t.numel())
        merged: list[list[int]] = []
        for a, b in spans:  # overlapping or touching ranges become one registration
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        for a, b in merged:
            err = cudart.cudaHostRegister(a, b - a, REGISTER_PORTABLE | REGISTER_READ_ONLY)
            code = int(getattr(err, "value", err))
            if code != 0:
                cudart.cudaGetLastError()  # clear it: torch's next launch check would report it as its own
                self.close()
                raise RuntimeError(
                    f"registering {(b - a) >> 20} MiB of expert banks with the GPU driver failed (error {code}); "
                    f"{lock_limit(b - a).reason}. Run without it: --moe-lock-host off"
                )
            self.ranges.append((a, b - a))
            self.bytes += b - a
        self.seconds += time.perf_counter() - t0
        self.keep.extend(tensors)

    def close(self) -> None:
        if not self.ranges:
            return
        cudart = torch.cuda.cudart()
        for a, _ in self.ranges:
            cudart.cudaHostUnregister(a)
        self.ranges.clear()
        self.bytes = 0
        self.keep.clear()


def bank_tensors(experts: Any) -> list[torch.Tensor]:
    """The host tensors holding one layer's expert stacks (gate, up, down)."""
    return [t.raw_torch() for t in (experts.gate, experts.up, experts.down)]


def register_banks(layers: Iterable[Any]) -> HostRegistration:
    reg = HostRegistration()
    tensors = [t for e in layers for t in bank_tensors(e) if t.device.type == "cpu"]
    reg.register(tensors)
    log.info("registered %.2f GiB of host expert banks with the GPU driver in %.1f s", reg.bytes / 2**30, reg.seconds)
    return reg
