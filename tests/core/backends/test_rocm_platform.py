"""AMD detection and gating without an AMD GPU: gfx targets are parsed as gfx targets,
RDNA1/2 default to FP16 activations with the reason, CUDA-only Triton launch options are
dropped on HIP, and the rocm backend's choices through the simulated HIP runtime."""

from __future__ import annotations

import pytest
import torch

from freetoken.backends import platform
from freetoken.backends.contract import BackendError
from freetoken.backends.handoff_io import SyncMode


@pytest.mark.parametrize(
    "arch,dtype",
    [("gfx1010", "float16"), ("gfx1012:xnack-", "float16"), ("gfx1030", "float16"), ("gfx1036", "float16"),
     ("gfx1100", "bfloat16"), ("gfx1151", "bfloat16"), ("gfx1201", "bfloat16"), ("gfx90a:sramecc+:xnack-", "bfloat16"),
     ("gfx942", "bfloat16"), ("gfx950", "bfloat16")],
)  # fmt: skip
def test_rocm_activation_dtype(arch, dtype):
    got, reason = platform.rocm_activation_dtype(arch)
    assert got == dtype and platform.amd_target(arch) in reason
    if dtype == "float16":
        assert "no BF16 dot-product instructions" in reason and "--dtype bfloat16" in reason


@pytest.mark.parametrize("bad", ["sm_90", "8.9", "", "gfx"])
def test_amd_target_refuses_what_is_not_a_gfx_target(bad):
    with pytest.raises(ValueError, match="not an AMD gfx target"):
        platform.amd_target(bad)


def test_triton_launch_options_follow_the_platform(monkeypatch):
    opts = {"num_warps": 4, "num_stages": 2, "maxnreg": 128, "ptx_version": 84, "waves_per_eu": 2}
    assert platform.triton_launch_options(opts, hip=True) == {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2}
    assert platform.triton_launch_options(opts, hip=False) == {"num_warps": 4, "num_stages": 2, "maxnreg": 128,
                                                               "ptx_version": 84}  # fmt: skip
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert "maxnreg" not in platform.triton_launch_options(opts)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert "waves_per_eu" not in platform.triton_launch_options(opts)


def test_hip_build_is_rocm_whatever_cuda_says(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.detect_platform().hardware == platform.ROCM


def _sim_rocm(**runtime_args):
    pytest.importorskip("freetoken_rocm")
    from freetoken_rocm.backend import RocmBackend

    from tests.qualify.sim_hip import SimHipBackend, SimHipRuntime

    class SimRocm(SimHipBackend, RocmBackend):  # the rocm backend's own methods over the simulated runtime
        pass

    return SimRocm(SimHipRuntime(**runtime_args))


def test_rocm_backend_defaults_rdna2_to_fp16_and_reports_why(caplog):
    rdna2 = _sim_rocm(arch="gfx1030")
    assert rdna2.default_dtype == "float16"
    assert "no BF16 dot-product instructions" in caplog.text
    caps = rdna2.capabilities()
    assert caps.extra["default_dtype"]["dtype"] == "float16"
    assert "capability" not in caps.extra["device"]
    assert _sim_rocm(arch="gfx1100").default_dtype == "bfloat16"


def test_locked_staging_and_flag_wait_sync_without_memops():
    """The expert cache's locked staging and its flag-wait ordering are open to HIP devices
    without stream memops; asking for memops there is a clear error."""
    backend = _sim_rocm(memops=False)
    bank = torch.randn(64, 32)
    handle = backend.staging().register_host(bank)
    assert handle.ptr == bank.data_ptr()
    sync = backend.gpu_sync(SyncMode.FLAG_WAIT_KERNEL)
    assert sync.mode is SyncMode.FLAG_WAIT_KERNEL and sync.graph_safe
    with pytest.raises(BackendError, match="stream memops unavailable.*CanUseStreamWaitValue"):
        backend.gpu_sync(SyncMode.STREAM_MEMOPS)
    assert backend.gpu_sync().mode is SyncMode.FLAG_WAIT_KERNEL  # graphs wanted: the flag kernels
