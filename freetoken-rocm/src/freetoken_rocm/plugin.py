"""Entry point ``rocm`` of the ``freetoken.backends`` group (cheap to import)."""

from __future__ import annotations

from freetoken.backends.hookspecs import hookimpl


@hookimpl
def freetoken_backend():
    from freetoken_rocm.backend import RocmBackend

    return RocmBackend
