"""The entry point module: cheap to import, no hardware access (see the hookspec)."""

from freetoken.backends.hookspecs import hookimpl


@hookimpl
def freetoken_backend():
    from freetoken_fakegpu.backend import FakeGpuBackend

    return FakeGpuBackend
