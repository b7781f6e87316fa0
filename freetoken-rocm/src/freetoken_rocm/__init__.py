"""freetoken_rocm: the AMD (ROCm/HIP) backend of FreeToken.

The native extension ``freetoken_rocm._C`` is built from the shared GPU sources that
freetoken-core ships (``freetoken/include/freetoken/gpu/``); the Python side is the
generic native backend in :mod:`freetoken.moe.native_backend`. Importing this package
is cheap: the extension loads on the backend's first probe.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _check_core_version() -> None:
    try:
        from freetoken import __version__ as core_version
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise ImportError("freetoken_rocm needs freetoken-core: pip install 'freetoken[rocm]'") from exc
    if core_version != __version__:
        raise ImportError(
            f"freetoken-rocm {__version__} does not match freetoken-core {core_version}: "
            f"install the same version of both (pip install 'freetoken[rocm]=={core_version}')"
        )


_check_core_version()
