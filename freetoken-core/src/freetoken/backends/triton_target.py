"""Where the engine's Triton kernels run, and the launch options they take there.

Every Triton kernel of the engine (the fused MoE kernels of :mod:`freetoken.kernels.moe_experts`,
the packed experts of :mod:`freetoken.kernels.moe_packed` that the expert cache and
locked fetch also run, the fused dense ops of :mod:`freetoken.kernels.dense_ops`,
decode attention of :mod:`freetoken.kernels.decode_attention`) asks this module
two things: whether Triton runs on a device (:func:`for_device`, ``usable`` and
``reason``), and how to launch there (:meth:`TritonTarget.launch_options`,
:meth:`TritonTarget.dot_precision`). The rule:

* NVIDIA (a CUDA build of torch): compute capability >= 8.0 where triton imports.
* AMD (``torch.version.hip`` set; the gfx target from ``gcnArchName``, never read as a
  compute capability): triton imports with its AMD backend and the target is one that
  backend generates matrix code for: CDNA2-4 (gfx90a, gfx940-942, gfx950) and RDNA3,
  RDNA3.5, RDNA4 (gfx11xx, gfx12xx). RDNA1/RDNA2 (gfx101x, gfx103x) have neither matrix
  nor BF16 dot-product instructions, older GCN/CDNA1 targets are not Triton targets: the
  torch implementations run there, and ``reason`` names the target.
* Anything else (a CPU tensor): no GPU target; Triton's interpreter (``TRITON_INTERPRET``)
  runs the kernels there with the options as written.

Launch options. The kernels' configurations were tuned on NVIDIA GPUs (the H200): warps of
32 threads, ``num_stages`` for sm_90's asynchronous copies, ``tf32`` dots on 16-bit inputs.
On AMD: a program keeps its thread count (a wave64 target gets half the warps, at least
one), ``num_stages`` is at most 2 (the AMD backend's default software pipelining), dots
take ``ieee`` input precision (the only one every AMD target accepts; 16-bit inputs
multiply the same either way), and options only the other backend knows are dropped
(:func:`freetoken.backends.platform.triton_launch_options`). Kernel bodies are the same on
both.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any, Optional

from freetoken.backends.platform import amd_target, triton_launch_options

log = logging.getLogger(__name__)

#: gfx targets whose matrix instructions Triton's AMD backend generates code for:
#: CDNA2 (gfx90a), CDNA3 (gfx940-942), CDNA4 (gfx950), RDNA3/3.5 (gfx11xx), RDNA4 (gfx12xx)
HIP_TARGETS = re.compile(r"gfx90a|gfx94[0-2]|gfx950|gfx11[0-9a-f]{2}|gfx12[0-9a-f]{2}")

#: most software-pipelining stages a launch asks of the AMD backend (its default)
HIP_MAX_STAGES = 2

#: the warp width the kernels' ``num_warps`` were chosen for
TUNED_WARP_SIZE = 32

#: compute capability the NVIDIA kernels need (BF16 MMA, cp.async)
MIN_CUDA_CAPABILITY = (8, 0)


def amd_family(target: str) -> str:
    """The architecture family of a gfx target, for messages (``gfx1030`` -> ``RDNA2``)."""
    families = (
        (r"gfx10[1][0-9a-f]", "RDNA1"), (r"gfx103[0-9a-f]", "RDNA2"), (r"gfx110[0-9a-f]", "RDNA3"),
        (r"gfx115[0-9a-f]", "RDNA3.5"), (r"gfx12[0-9a-f]{2}", "RDNA4"), (r"gfx908", "CDNA1"), (r"gfx90a", "CDNA2"),
        (r"gfx94[0-2]", "CDNA3"), (r"gfx950", "CDNA4"), (r"gfx9[0-9a-f]{1,2}", "GCN5/Vega"),
    )  # fmt: skip
    for pattern, name in families:
        if re.fullmatch(pattern, target):
            return name
    return "unknown family"


def amd_warp_size(target: str) -> int:
    """Wavefront width Triton compiles a gfx target for: 64 on gfx9 (GCN, CDNA), 32 from gfx10 (RDNA)."""
    return 32 if int(target[3:-2] or 0) >= 10 else 64  # the digits before the last two: the major version


@dataclasses.dataclass(frozen=True)
class TritonTarget:
    """One device as a Triton target: whether the engine's kernels run there, and how.

    ``backend``: ``cuda``, ``hip`` or ``none``; ``arch``: ``sm_90``, ``gfx942`` or ``""``."""

    backend: str
    arch: str
    warp_size: int
    usable: bool
    reason: str

    @property
    def hip(self) -> bool:
        return self.backend == "hip"

    def launch_options(self, num_warps: int, num_stages: Optional[int] = None, **extra: Any) -> dict[str, Any]:
        """Keyword options of a kernel launch whose ``num_warps`` (threads per program / 32),
        ``num_stages`` and ``extra`` were chosen on NVIDIA GPUs, as this target takes them."""
        if not self.hip:
            opts: dict[str, Any] = {**extra, "num_warps": num_warps}
            if num_stages is not None:
                opts["num_stages"] = num_stages
            return triton_launch_options(opts, hip=False) if extra else opts
        opts = {**extra, "num_warps": max(1, num_warps * TUNED_WARP_SIZE // self.warp_size)}
        if num_stages is not None:
            opts["num_stages"] = min(num_stages, HIP_MAX_STAGES)
        return triton_launch_options(opts, hip=True)

    def dot_precision(self, float32_inputs: bool) -> str:
        """``tl.dot``'s ``input_precision``: exact (``ieee``) for float32 inputs; on NVIDIA
        ``tf32`` for 16-bit ones (where it changes nothing), on AMD always ``ieee``."""
        return "ieee" if float32_inputs or self.hip else "tf32"

    def compile_target(self) -> Any:
        """Triton's ``GPUTarget`` of this device, for compiling ahead of time."""
        from triton.backends.compiler import GPUTarget

        if self.backend == "hip":
            return GPUTarget("hip", self.arch, self.warp_size)
        if self.backend == "cuda":
            return GPUTarget("cuda", int(self.arch.removeprefix("sm_")), 32)
        raise ValueError(f"no GPU target: {self.reason}")


def no_target(reason: str) -> TritonTarget:
    """No GPU: the kernels run only in Triton's interpreter, with their options as written."""
    return TritonTarget("none", "", TUNED_WARP_SIZE, False, reason)


def _triton_backends() -> tuple[frozenset[str], Optional[str]]:
    """The backends of the installed triton (``amd``, ``nvidia``), or why it does not import."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError as exc:
        return frozenset(), f"triton is not importable: {exc}"
    return frozenset(backends), None


def cuda_target(capability: tuple[int, int]) -> TritonTarget:
    """The Triton target of an NVIDIA GPU of ``capability``."""
    major, minor = int(capability[0]), int(capability[1])
    arch = f"sm_{major}{minor}"
    cap = (major, minor)
    if cap < MIN_CUDA_CAPABILITY:
        return TritonTarget("cuda", arch, 32, False, f"compute capability {cap} < {MIN_CUDA_CAPABILITY}")
    names, error = _triton_backends()
    if error:
        return TritonTarget("cuda", arch, 32, False, error)
    if "nvidia" not in names:
        return TritonTarget("cuda", arch, 32, False, f"the installed triton has no NVIDIA backend ({sorted(names)})")
    return TritonTarget("cuda", arch, 32, True, f"triton on compute capability {cap}")


def hip_target(arch: str) -> TritonTarget:
    """The Triton target of an AMD GPU whose architecture name is ``arch``
    (``gcnArchName``: ``"gfx942:sramecc+:xnack-"``); a gfx name is never a compute capability."""
    target = amd_target(arch)
    family = amd_family(target)
    warp = amd_warp_size(target)
    if not HIP_TARGETS.fullmatch(target):
        if family in ("RDNA1", "RDNA2"):
            why = "no matrix or BF16 dot-product instructions"
        else:
            why = "outside the targets Triton's AMD backend is built and tested for"
        return TritonTarget(
            "hip", target, warp, False,
            f"{target} ({family}): {why}; Triton kernels run on CDNA2-4 (gfx90a, gfx942, gfx950) and RDNA3/4 "
            f"(gfx11xx, gfx12xx), so the torch implementations run here",
        )  # fmt: skip
    names, error = _triton_backends()
    if error:
        return TritonTarget("hip", target, warp, False, error)
    if "amd" not in names:
        return TritonTarget("hip", target, warp, False,
                            f"the installed triton has no AMD backend ({sorted(names)}): install the ROCm build "
                            "of triton that matches the ROCm torch (pytorch-triton-rocm)")  # fmt: skip
    return TritonTarget("hip", target, warp, True, f"triton on {target} ({family}, wave{warp})")


@functools.lru_cache(maxsize=None)
def _device_target(device: Any) -> TritonTarget:
    import torch

    if device.type != "cuda":
        return no_target(f"device {device} is not a GPU")
    if torch.version.hip:
        return hip_target(str(torch.cuda.get_device_properties(device).gcnArchName))
    return cuda_target(torch.cuda.get_device_capability(device))


def for_device(device: Any) -> TritonTarget:
    """The Triton target of ``device`` (a ``torch.device`` or its name; ``cuda`` without an
    index is the current device). Decided once per device."""
    import torch

    if isinstance(device, torch.device) and (device.index is not None or device.type != "cuda"):
        return _device_target(device)  # a tensor's device: the launch sites' case
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_target(dev)
