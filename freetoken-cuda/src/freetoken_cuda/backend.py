"""The NVIDIA backend: the generic native GPU backend bound to ``freetoken_cuda._C``."""

from __future__ import annotations

import ctypes
from typing import ClassVar

from freetoken.backends.contract import CpuExperts
from freetoken.native_gpu.backend import NativeGpuBackend


class CudaBackend(NativeGpuBackend):
    """FreeToken on an NVIDIA GPU (stream memops, mapped-memory KernelIO, CUDA graphs)."""

    name: ClassVar[str] = "cuda"
    hardware: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 100
    native_module: ClassVar[str] = "freetoken_cuda._C"
    torch_flavour: ClassVar[str] = "cuda"
    #: ``--moe-locked-fetch auto`` applies here: the plan's share until the session's start
    #: measures the count (about a quarter: PCIe's ~55 GB/s against the CPU workers' ~100 GB/s
    #: of host memory on the H200 machine; docs/benchmarks.md)
    locked_fetch_share: ClassVar[float] = 0.25
    install_hint: ClassVar[str] = (
        "reinstall with nvcc available: CUDA_HOME=/usr/local/cuda pip install --force-reinstall 'freetoken[cuda]'"
    )

    @classmethod
    def driver_hint(cls) -> str:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded)"
        return ""

    def cpu_experts(self) -> CpuExperts:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()
