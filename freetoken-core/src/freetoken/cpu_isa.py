"""The host CPU's instruction-set extensions that matter to the CPU expert kernels.

Read from ``/proc/cpuinfo`` (Linux); elsewhere the list is empty and ``source``
says why. freetoken-cpu-moe picks its kernels at run time from the same flags.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any, Optional

#: Flags worth reporting, in order of increasing capability.
RELEVANT_FLAGS = (
    "sse4_2",
    "avx",
    "f16c",
    "fma",
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model: Optional[str]
    machine: str
    logical_cores: Optional[int]
    flags: tuple[str, ...]
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "machine": self.machine,
            "logical_cores": self.logical_cores,
            "isa": list(self.flags),
            "source": self.source,
        }


def parse_cpuinfo(text: str) -> tuple[Optional[str], tuple[str, ...]]:
    """Model name and the relevant flags of the first processor in ``/proc/cpuinfo`` text."""
    model = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, tuple(f for f in RELEVANT_FLAGS if f in flags)


def detect_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """What this machine's CPU offers. Never raises."""
    machine = platform.machine()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as fh:
            model, flags = parse_cpuinfo(fh.read())
        source = cpuinfo_path
    except OSError as exc:
        model, flags, source = None, (), f"unavailable ({exc.strerror or exc})"
    return CpuInfo(model=model or platform.processor() or None, machine=machine,
                   logical_cores=os.cpu_count(), flags=flags, source=source)
