"""What the installed torch says about this machine: the input to automatic selection.

The automatic rule:

* ``torch.version.hip`` is set               -> ``rocm`` (a HIP build of torch drives AMD GPUs)
* ``torch.version.cuda`` is set and a GPU is
  visible (``torch.cuda.is_available()``)    -> ``cuda``
* otherwise                                  -> ``cpu``

Everything is read at call time from the ``torch`` module, so tests can fake a
build by setting ``torch.version.hip``/``torch.version.cuda`` and replacing
``torch.cuda.is_available``/``torch.cuda.device_count``.
"""

from __future__ import annotations

import dataclasses
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
