"""Programmatic dependent launch of a decode step's kernels (NVIDIA, compute capability 9.0+).

Kernels in one stream normally run strictly one after another: the next one is scheduled
only when the previous one has completed, so every launch starts cold (its blocks placed,
then its first loads issued). A kernel launched with programmatic dependent launch may be
scheduled while the kernel before it still runs: it does what depends on nothing written
before it (the native GEMVs ask their first weight rows into L2), waits for the kernel
before it (``griddepcontrol.wait``: that one completed, its writes visible), and lets the
next such kernel be scheduled (``griddepcontrol.launch_dependents``). The kernels that take
part wait on entry, before they read or write anything another kernel touches, so any
kernel may come before or after them: the native GEMVs, norm GEMV and expert kernels
(``freetoken/gpu/packed_gemv.cuh``, ``packed_moe.cuh``) and the Triton q/k norm and RoPE,
decode attention and routing kernels.

One process-wide setting, turned on by the GPU session with ``--gpu-dependent-launch on``
(off by default: on the H200 a decode step took longer with it, docs/gpu.md);
:func:`active` tells a launch site whether its device takes it.
"""

from __future__ import annotations

from typing import Any

_enabled = False
_capable: dict[str, str] = {}


def set_enabled(on: bool) -> None:
    """Turn dependent launches on or off for every later launch in this process."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def refusal(device: Any) -> str:
    """"" where ``device`` takes dependent launches, else why not (cached per device)."""
    import torch

    dev = torch.device(device)
    key = str(dev)
    if key not in _capable:
        if dev.type != "cuda":
            why = f"device {dev} is not a GPU"
        elif torch.version.hip is not None:
            why = "ROCm has no programmatic dependent launch"
        else:
            major, minor = torch.cuda.get_device_capability(dev)
            why = "" if major >= 9 else f"compute capability {major}.{minor} < 9.0"
        _capable[key] = why
    return _capable[key]


def active(device: Any) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch now."""
    return _enabled and not refusal(device)


def triton_options(device: Any) -> dict[str, Any]:
    """Launch options of a Triton kernel that waits on entry (its ``GDC`` constant):
    ``launch_pdl`` where dependent launches are active, else none."""
    return {"launch_pdl": True} if active(device) else {}
