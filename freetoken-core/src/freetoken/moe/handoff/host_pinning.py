"""Page-locking the host expert banks and registering them with the GPU driver.

Copies from pageable memory go through the driver's staging buffers at a fraction of the
PCIe bandwidth and block the calling thread; from registered memory they are DMA at full
speed and asynchronous. The banks are the checkpoint's bytes (a read-only file mapping for
GGUF files), so they are registered read-only; through the backend's Staging (the contract),
never the driver directly. Registration locks the pages in RAM for the
process's lifetime: what it costs is RAM that the page cache can no longer reclaim.

:func:`lock_limit` reports whether the OS lets this process lock memory (RLIMIT_MEMLOCK;
the driver's registration pins pages itself, but a low limit usually means a container or
a user policy that also refuses it), for ``freetoken doctor``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from typing import Any, Iterable, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

@dataclasses.dataclass
class LockLimit:
    soft: Optional[int]  # bytes, None = unlimited
    hard: Optional[int]
    can_lock: bool
    reason: str


#: below this RLIMIT_MEMLOCK, no real model's expert banks could be mlock()ed
USEFUL_LOCK_BYTES = 1 << 30


def lock_limit(need: int = 0) -> LockLimit:
    """RLIMIT_MEMLOCK of this process, and whether ``need`` bytes (default: a useful amount,
    :data:`USEFUL_LOCK_BYTES`) can be locked under it."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return LockLimit(None, None, False, "no RLIMIT_MEMLOCK on this OS")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    s, h = (None if v == inf else int(v) for v in (soft, hard))
    if s is None:
        return LockLimit(s, h, True, "RLIMIT_MEMLOCK unlimited")
    need = need or USEFUL_LOCK_BYTES
    if s < need:
        return LockLimit(s, h, False, f"RLIMIT_MEMLOCK is {s >> 20} MiB, below the {need >> 20} MiB to lock "
                                      "(raise it: `ulimit -l unlimited`, memlock in /etc/security/limits.conf, or "
                                      "the container's --ulimit memlock=-1)")
    return LockLimit(s, h, True, f"RLIMIT_MEMLOCK {s >> 20} MiB")


#: neighbouring read-only ranges (one file mapping) closer than this are registered as one
MERGE_GAP = 1 << 20


def _read_only(raw: Any) -> bool:
    data = raw.data
    return not isinstance(data, torch.Tensor) and not np.asarray(data).flags.writeable


class HostRegistration:
    """Host ranges page-locked and registered with the driver through the backend's
    :meth:`~freetoken.backends.handoff_io.Staging.register_host` (``mapped``: kernels may also
    read them in place at :meth:`device_address`); :meth:`close` releases them."""

    def __init__(self, staging: Any, mapped: bool = False) -> None:
        self.staging = staging
        self.mapped = mapped
        self.ranges: list[tuple[int, int, int]] = []  # (host start, size, device start)
        self.handles: list[Any] = []
        self.keep: list[Any] = []  # what owns the registered memory (kept alive)
        self.bytes = 0
        self.seconds = 0.0

    def register(self, spans: Iterable[tuple[torch.Tensor, bool]]) -> None:
        """Register ``(tensor, read_only)`` spans (CPU, contiguous); overlapping ranges, and
        read-only ones less than :data:`MERGE_GAP` apart, become one registration. Raises
        RuntimeError naming the driver's refusal and the flag that avoids it."""
        items = sorted(((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), ro, t) for t, ro in spans
                        if t.numel()), key=lambda v: v[0])  # fmt: skip
        merged: list[list[Any]] = []
        for a, b, ro, t in items:
            last = merged[-1] if merged else None
            if last is not None and (a <= last[1] or (ro and last[2] and a - last[1] < MERGE_GAP)):
                last[1] = max(last[1], b)
                last[2] = last[2] and ro
            else:
                merged.append([a, b, ro])
            self.keep.append(t)
        t0 = time.perf_counter()
        for a, b, ro in merged:
            view = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * (b - a)).from_address(a)))
            try:
                handle = self.staging.register_host(view, mapped=self.mapped, read_only=ro)
            except Exception as exc:  # noqa: BLE001 - the driver's refusal, reported with advice
                self.close()
                raise RuntimeError(
                    f"page-locking {(b - a) >> 20} MiB of expert banks failed ({exc}); {lock_limit(b - a).reason}. "
                    "Run without it: --moe-lock-host off"
                ) from exc
            self.handles.append(handle)
            device = int(getattr(handle, "device_ptr", 0) or 0)
            self.ranges.append((a, b - a, device))
            self.bytes += b - a
        self.seconds += time.perf_counter() - t0

    def device_address(self, tensor: torch.Tensor) -> int:
        """Where kernels read ``tensor``'s first byte (a mapped registration covering it)."""
        p = tensor.data_ptr()
        for a, n, d in self.ranges:
            if a <= p < a + n:
                if not d:
                    raise RuntimeError("host banks registered without a device mapping")
                return d + (p - a)
        raise KeyError("tensor not in a registered range")

    def close(self) -> None:
        self.handles.clear()  # each handle unregisters its range when released
        self.ranges.clear()
        self.keep.clear()
        self.bytes = 0


def bank_spans(experts: Any) -> list[tuple[torch.Tensor, bool]]:
    """(host tensor, read-only) of one layer's expert stacks (gate, up, down)."""
    return [(t.raw_torch(), _read_only(t)) for t in (experts.gate, experts.up, experts.down)]


def register_banks(staging: Any, layers: Iterable[Any], mapped: bool = False) -> HostRegistration:
    reg = HostRegistration(staging, mapped)
    reg.register([s for e in layers for s in bank_spans(e) if s[0].device.type == "cpu"])
    log.info("page-locked %.2f GiB of host expert banks%s in %.1f s", reg.bytes / 2**30,
             " (mapped for the GPU)" if mapped else "", reg.seconds)
    return reg
