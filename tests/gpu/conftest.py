"""Fixtures of the GPU tests (run on the H200 machine; skipped without a GPU)."""

from __future__ import annotations

import pytest


def gpu_backend_class():
    import torch

    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        from freetoken_rocm.backend import RocmBackend

        return RocmBackend
    from freetoken_cuda.backend import CudaBackend

    return CudaBackend


@pytest.fixture(scope="session")
def backend():
    cls = gpu_backend_class()
    if cls is None:
        pytest.skip("no GPU visible")
    probe = cls.probe()
    assert probe.available, probe.reason
    return cls()
