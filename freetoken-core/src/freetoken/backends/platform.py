"""What the installed torch says about this machine: the input to automatic selection.

The automatic rule:

* ``torch.version.hip`` is set               -> ``rocm`` (a HIP build of torch drives AMD GPUs)
* ``torch.version.cuda`` is set and a GPU is
  visible (``torch.cuda.is_available()``)    -> ``cuda``
* otherwise                                  -> ``cpu``

Everything is read at call time from the ``torch`` module, so tests can fake a
build by setting ``torch.version.hip``/``torch.version.cuda`` and replacing
``torch.cuda.is_available``/``torch.cuda.device_count``.

The platform is decided by ``torch.version.hip`` alone: a HIP build reports its GPUs
through ``torch.cuda`` too, and an AMD gfx target is never read as an NVIDIA compute
capability (:func:`amd_target`, :func:`rocm_activation_dtype`,
:func:`triton_launch_options`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

ROCM = "rocm"
CUDA = "cuda"
CPU = "cpu"


@dataclasses.dataclass(frozen=True)
class TorchPlatform:
    """The torch build and the GPUs it can see."""

    torch_version: Optional[str]
    cuda_version: Optional[str]
    hip_version: Optional[str]
    gpu_count: int
    error: Optional[str] = None

    @property
    def hardware(self) -> str:
        """Which backend family the automatic rule picks: ``rocm``, ``cuda`` or ``cpu``."""
        if self.hip_version:
            return ROCM
        if self.cuda_version and self.gpu_count > 0:
            return CUDA
        return CPU

    @property
    def rule(self) -> str:
        """The automatic rule that fired, as a sentence for logs and ``freetoken doctor``."""
        if self.hip_version:
            return f"torch {self.torch_version} is a ROCm/HIP build (HIP {self.hip_version})"
        if self.cuda_version and self.gpu_count > 0:
            return f"torch {self.torch_version} is a CUDA build (CUDA {self.cuda_version}) and sees {self.gpu_count} GPU(s)"
        if self.cuda_version:
            return f"torch {self.torch_version} is a CUDA build (CUDA {self.cuda_version}) but sees no GPU"
        if self.error:
            return f"torch could not be inspected ({self.error})"
        return f"torch {self.torch_version} has no GPU support (CPU-only build)"

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["hardware"] = self.hardware
        out["rule"] = self.rule
        return out


def detect_platform() -> TorchPlatform:
    """Inspect the installed torch. Never raises: a broken torch is reported in ``error``."""
    try:
        import torch
    except Exception as exc:  # torch missing or broken: the CPU rule, with the reason kept
        return TorchPlatform(None, None, None, 0, error=f"import torch failed: {exc}")
    version = getattr(torch, "version", None)
    cuda_version = getattr(version, "cuda", None)
    hip_version = getattr(version, "hip", None)
    gpu_count = 0
    error = None
    if cuda_version or hip_version:
        try:
            if torch.cuda.is_available():
                gpu_count = int(torch.cuda.device_count())
        except Exception as exc:  # driver trouble: no GPU visible, reason kept
            error = f"torch.cuda query failed: {exc}"
    return TorchPlatform(str(torch.__version__), cuda_version, hip_version, gpu_count, error)


# --------------------------------------------------------------------------------------
# AMD targets: gfx names are never compute capabilities
# --------------------------------------------------------------------------------------

#: RDNA1 (gfx101x) and RDNA2 (gfx103x) have no BF16 dot-product instructions: BF16 matmuls
#: run through conversions there, FP16 ones natively.
_NO_BF16_DOT = re.compile(r"gfx10[13][0-9a-f]")


def amd_target(arch: str) -> str:
    """The gfx target of a HIP device's architecture name (``"gfx90a:sramecc+:xnack-"`` -> ``"gfx90a"``)."""
    target = arch.split(":", 1)[0].strip().lower()
    if not re.fullmatch(r"gfx[0-9a-f]+", target):
        raise ValueError(f"not an AMD gfx target: {arch!r}")
    return target


def rocm_activation_dtype(arch: str) -> tuple[str, str]:
    """The activation dtype ``--dtype auto`` means on an AMD GPU, and why."""
    target = amd_target(arch)
    if _NO_BF16_DOT.fullmatch(target):
        return "float16", (
            f"{target} (RDNA1/RDNA2) has no BF16 dot-product instructions: FP16 activations by default, "
            "which take the copy hand-off (KernelIO carries BF16); --dtype bfloat16 overrides"
        )
    return "bfloat16", f"{target}: BF16 activations"


#: Triton launch options that only the NVIDIA backend of Triton accepts.
CUDA_ONLY_LAUNCH_OPTIONS = frozenset({"maxnreg", "ptx_version"})
#: Triton launch options that only the AMD backend of Triton accepts.
ROCM_ONLY_LAUNCH_OPTIONS = frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack"})


def triton_launch_options(options: dict[str, Any], hip: Optional[bool] = None) -> dict[str, Any]:
    """``options`` without those the running platform's Triton backend does not accept.

    ``hip``: whether torch drives the GPU through HIP (default: ``torch.version.hip``)."""
    if hip is None:
        hip = detect_platform().hip_version is not None
    drop = CUDA_ONLY_LAUNCH_OPTIONS if hip else ROCM_ONLY_LAUNCH_OPTIONS
    return {k: v for k, v in options.items() if k not in drop}
