"""Does a checkpoint fit in RAM? Checked before anything is allocated."""

from __future__ import annotations

import os
from typing import Optional


class InsufficientMemory(MemoryError):
    """The model (plus its KV cache) cannot fit; the message has the numbers."""


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def available_ram() -> Optional[int]:
    """Bytes the kernel says can be used without swapping (MemAvailable), or None."""
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(what: str, weights: int, copies: int = 0, kv: int = 0, available: Optional[int] = None) -> None:
    """Raise :class:`InsufficientMemory` if ``weights`` (memory-mapped file bytes that
    must stay resident), ``copies`` (bytes we allocate) and ``kv`` exceed the RAM
    available now. Override the limit with ``FREETOKEN_MEMORY_LIMIT`` (bytes)."""
    if available is None:
        env = os.environ.get("FREETOKEN_MEMORY_LIMIT")
        available = int(env) if env else available_ram()
    if available is None:
        return
    need = weights + copies + kv
    if need > available:
        raise InsufficientMemory(
            f"{what} does not fit in RAM: needs {gib(need)} (weights {gib(weights)}, copies {gib(copies)}, "
            f"KV cache {gib(kv)}) but only {gib(available)} is available. Use a smaller quantization, "
            "fewer layers, or a smaller --kv-cache-tokens."
        )
