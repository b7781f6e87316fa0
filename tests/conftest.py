"""Suite-wide pytest configuration.

Tests marked ``@pytest.mark.gpu`` need a CUDA or ROCm GPU visible to torch; on a
machine without one they are skipped with the reason (CI has none; they run on the
H200 machine).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


def _gpu_absent_reason() -> str | None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
        return f"no GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip})"
    except Exception as exc:  # a broken torch is reported by the tests that need it
        return f"torch GPU query failed: {exc}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_absent_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def _physical_core(cpu: int) -> tuple[str, str]:
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    with open(f"{base}/physical_package_id") as f, open(f"{base}/core_id") as g:
        return f.read().strip(), g.read().strip()


@pytest.fixture
def physical_core() -> Callable[[int], tuple[str, str]]:
    """(package id, core id) of a CPU as the kernel's sysfs topology gives them: the tests'
    own reading, independent of how the code under test finds a CPU's core."""
    return _physical_core
