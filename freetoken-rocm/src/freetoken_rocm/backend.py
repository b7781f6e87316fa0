"""The AMD backend: the generic native GPU backend bound to ``freetoken_rocm._C``."""

from __future__ import annotations

from typing import ClassVar

from freetoken.backends.contract import CpuExperts
from freetoken.moe.native_backend import NativeGpuBackend


class RocmBackend(NativeGpuBackend):
    """FreeToken on an AMD GPU through HIP (stream memops, mapped-memory KernelIO, HIP graphs)."""

    name: ClassVar[str] = "rocm"
    hardware: ClassVar[str] = "rocm"
    priority: ClassVar[int] = 100
    native_module: ClassVar[str] = "freetoken_rocm._C"
    torch_flavour: ClassVar[str] = "hip"
    install_hint: ClassVar[str] = (
        "reinstall with hipcc available: ROCM_PATH=/opt/rocm pip install --force-reinstall 'freetoken[rocm]' "
        "(FREETOKEN_ROCM_ARCH=gfx1100 to pick the GPU target)"
    )

    def cpu_experts(self) -> CpuExperts:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()
