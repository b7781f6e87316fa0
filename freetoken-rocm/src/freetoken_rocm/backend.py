"""The AMD backend: the generic native GPU backend bound to ``freetoken_rocm._C``."""

from __future__ import annotations

import logging
from typing import ClassVar, Optional

from freetoken.backends.contract import Capabilities, CpuExperts
from freetoken.backends.platform import rocm_activation_dtype
from freetoken.backends.triton_target import hip_target
from freetoken.native_gpu.backend import NativeGpuBackend

log = logging.getLogger(__name__)


class RocmBackend(NativeGpuBackend):
    """FreeToken on an AMD GPU through HIP: KernelIO on fine-grained mapped memory, the
    event-ordered copy path (a system-release event between the copies and the memop ready
    write), explicit flag-kernel graph nodes where capture drops memops, host callbacks; the
    engine's Triton kernels where :mod:`freetoken.backends.triton_target` accepts the gfx target."""

    name: ClassVar[str] = "rocm"
    hardware: ClassVar[str] = "rocm"
    priority: ClassVar[int] = 100
    native_module: ClassVar[str] = "freetoken_rocm._C"
    torch_flavour: ClassVar[str] = "hip"
    memop_write_orders_copies: ClassVar[bool] = False  # the release event orders them
    install_hint: ClassVar[str] = (
        "reinstall with hipcc available: ROCM_PATH=/opt/rocm pip install --force-reinstall 'freetoken[rocm]' "
        "(FREETOKEN_ROCM_ARCH=gfx1100 to pick the GPU target); see docs/install_amd.md"
    )

    def __init__(self, device_index: Optional[int] = None) -> None:
        super().__init__(device_index)
        self._dtype_choice: Optional[tuple[str, str]] = None

    @property  # type: ignore[override]
    def default_dtype(self) -> str:  # noqa: D401 - what ``--dtype auto`` means on this GPU
        """BF16, except on RDNA1/RDNA2 (no BF16 dot instructions): FP16, with the reason logged."""
        if self._dtype_choice is None:
            try:
                self._dtype_choice = rocm_activation_dtype(str(self.device_info()["arch"]))
            except Exception as exc:  # noqa: BLE001 - an unreadable target keeps the default
                self._dtype_choice = ("bfloat16", f"device architecture unreadable ({exc}): BF16 activations")
            level = logging.WARNING if self._dtype_choice[0] != "bfloat16" else logging.INFO
            log.log(level, "--dtype auto: %s", self._dtype_choice[1])
        return self._dtype_choice[0]

    def dtype_reason(self) -> str:
        """Why ``--dtype auto`` picked :attr:`default_dtype` (shown by doctor and the logs)."""
        _ = self.default_dtype
        assert self._dtype_choice is not None
        return self._dtype_choice[1]

    def cpu_experts(self) -> CpuExperts:
        from freetoken_cpu_moe.host_experts import HostExperts

        return HostExperts()

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        caps.extra["default_dtype"] = {"dtype": self.default_dtype, "reason": self.dtype_reason()}
        try:
            target = hip_target(str(caps.extra["device"]["arch"]))
            caps.extra["triton"] = {"usable": target.usable, "target": target.arch, "reason": target.reason}
        except Exception as exc:  # noqa: BLE001 - an unreadable target: the torch implementations, reason kept
            caps.extra["triton"] = {"usable": False, "target": None, "reason": f"device architecture unreadable ({exc})"}
        return caps
