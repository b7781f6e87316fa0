"""Whether the Triton kernels run on a device: Triton where
:func:`freetoken.backends.triton_target.for_device` accepts the device and triton imports,
else the torch implementations. Callers read :func:`default_impl` through this module, so a
test may point it at Triton's interpreter."""

from __future__ import annotations

from typing import Any


def default_impl(device: Any) -> tuple[str, str]:
    """(implementation, why) for kernels on ``device``: ``"triton"`` where
    :func:`freetoken.backends.triton_target.for_device` says it runs, else ``"torch"``."""
    from freetoken.backends import triton_target

    target = triton_target.for_device(device)
    if not target.usable:
        return "torch", target.reason
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return "torch", f"triton is not importable: {exc}"
    return "triton", target.reason


def check_triton(device: Any) -> None:
    """Raise ValueError when the Triton implementation cannot run on ``device``: triton does
    not import, or ``device`` is a GPU whose target Triton does not run on (CPU tensors run
    in Triton's interpreter)."""
    from freetoken.backends import triton_target

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"impl='triton' needs triton: {exc}") from exc
    target = triton_target.for_device(device)
    if target.backend != "none" and not target.usable:
        raise ValueError(f"impl='triton' on {device}: {target.reason}; use impl='torch' (or 'auto')")
