"""The NVIDIA backend: the generic native GPU backend bound to ``freetoken_cuda._C``."""

from __future__ import annotations

from typing import ClassVar

from freetoken.moe.native_backend import NativeGpuBackend


class CudaBackend(NativeGpuBackend):
    """FreeToken on an NVIDIA GPU (stream memops, mapped-memory KernelIO, CUDA graphs)."""

    name: ClassVar[str] = "cuda"
    hardware: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 100
    native_module: ClassVar[str] = "freetoken_cuda._C"
    torch_flavour: ClassVar[str] = "cuda"
    install_hint: ClassVar[str] = (
        "reinstall with nvcc available: CUDA_HOME=/usr/local/cuda pip install --force-reinstall 'freetoken[cuda]'"
    )
