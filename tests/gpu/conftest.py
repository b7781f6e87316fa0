"""Fixtures of the GPU tests (run on the H200 machine; skipped without a GPU).

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: the switch is
read when :mod:`freetoken.moe.triton_moe` is imported (by the tests, after this file), so
it is set here, first, for the whole session.
"""

from __future__ import annotations

import os

import pytest


def _interpret_triton_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_gpu()


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
