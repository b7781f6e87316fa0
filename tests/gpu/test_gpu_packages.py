"""CPU-runnable checks of the GPU packages: built extensions, plugins, probes, version skew.

On a machine without a GPU the probes must answer available=False with the reason and
never raise; where the compiler was present at install time the extension must import
and expose the shared native surface.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import shutil
import sys

import pytest

PACKAGES = [
    ("cuda", "freetoken_cuda", "CudaBackend", "nvcc", "cuda"),
    ("rocm", "freetoken_rocm", "RocmBackend", "hipcc", "hip"),
]

NATIVE_SURFACE = (
    "device_count", "device_info", "runtime_version", "driver_version", "host_alloc", "host_free",
    "host_register", "host_unregister", "stream_is_capturing", "memop_write", "memop_wait",
    "flag_write_kernel", "flag_wait_kernel", "kio_publish", "kio_combine", "host_callback_publish",
    "host_callback_wait", "graph_memop_probe",
)  # fmt: skip


def _installed(pkg: str) -> None:
    dist = pkg.replace("_", "-")
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed in this environment")


def _gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("name,pkg,cls,compiler,api", PACKAGES)
def test_entry_point_and_backend_class(name, pkg, cls, compiler, api):
    _installed(pkg)
    eps = {ep.name: ep for ep in md.entry_points(group="freetoken.backends")}
    assert eps[name].value == f"{pkg}.plugin"
    plugin = eps[name].load()
    backend_cls = plugin.freetoken_backend()
    assert backend_cls.__name__ == cls
    from freetoken.backends.contract import BACKEND_API_VERSION, Backend

    assert issubclass(backend_cls, Backend)
    assert backend_cls.name == name and backend_cls.hardware == name
    assert backend_cls.api_version == BACKEND_API_VERSION
    assert backend_cls.priority > 0


@pytest.mark.parametrize("name,pkg,cls,compiler,api", PACKAGES)
def test_extension_built_when_compiler_present(name, pkg, cls, compiler, api):
    _installed(pkg)
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed here: {pkg}._C is expected to be absent")
    native = importlib.import_module(f"{pkg}._C")
    assert native.API == api
    missing = [f for f in NATIVE_SURFACE if not hasattr(native, f)]
    assert not missing, missing
    from freetoken import handoff

    assert native.HANDOFF_ABI_VERSION == handoff.ABI_VERSION
    assert native.runtime_version() > 0


@pytest.mark.parametrize("name,pkg,cls,compiler,api", PACKAGES)
def test_probe_without_gpu_says_why(name, pkg, cls, compiler, api):
    if _gpu_visible():
        pytest.skip("a GPU is visible: covered by tests/gpu")
    backend_cls = importlib.import_module(f"{pkg}.backend").__dict__[cls]
    result = backend_cls.probe()
    assert result.available is False
    assert result.reason and (name in result.reason or pkg in result.reason)


def test_probe_reports_missing_extension(monkeypatch):
    from freetoken.native_gpu import backend as native_backend
    from freetoken_cuda.backend import CudaBackend

    def fail(module):
        raise ImportError(f"No module named {module!r}")

    monkeypatch.setattr(native_backend, "_load_native", fail)
    result = CudaBackend.probe()
    assert result.available is False
    assert "freetoken_cuda._C is not available" in result.reason
    assert "nvcc" in result.reason


@pytest.mark.parametrize("pkg", ["freetoken_cuda", "freetoken_rocm"])
def test_version_skew_is_a_clear_error(pkg, monkeypatch):
    _installed(pkg)
    importlib.import_module(pkg)
    import freetoken

    monkeypatch.setattr(freetoken, "__version__", "9.9.9")
    saved = sys.modules.pop(pkg)
    try:
        with pytest.raises(ImportError, match=r"does not match freetoken-core 9\.9\.9"):
            importlib.import_module(pkg)
    finally:
        sys.modules[pkg] = saved
