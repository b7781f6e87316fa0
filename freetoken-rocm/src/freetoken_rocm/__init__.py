"""freetoken_rocm: the AMD (ROCm/HIP) backend of FreeToken.

The native extension ``freetoken_rocm._C`` is built from the shared GPU sources that
freetoken-core ships (``freetoken/include/freetoken/gpu/``); the Python side is the
generic native backend in :mod:`freetoken.native_gpu.backend`. Importing this package
is cheap: the extension loads on the backend's first probe.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _check_core_version() -> None:
    try:
        from freetoken.versioning import require_core_version
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise ImportError("freetoken_rocm needs freetoken-core: install freetoken-core of the same version (docs/install.md)") from exc
    require_core_version("freetoken-rocm", __version__)


_check_core_version()
