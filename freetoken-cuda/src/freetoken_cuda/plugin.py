"""Entry point ``cuda`` of the ``freetoken.backends`` group (cheap to import)."""

from __future__ import annotations

from freetoken.backends.hookspecs import hookimpl


@hookimpl
def freetoken_backend():
    from freetoken_cuda.backend import CudaBackend

    return CudaBackend
