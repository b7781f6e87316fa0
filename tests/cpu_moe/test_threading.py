"""The threading knobs of the CPU backend: the pool's spin time (set to 0 while torch's
threads own the cores) and the torch thread count for prompt steps."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cpu_moe_cases import cm
from cpu_moe_reference import make_weights

from freetoken_cpu_moe.backend import TORCH_THREADS_ENV, prefill_torch_threads


def test_pool_spin_time_is_settable_and_sleeping_workers_wake(rng) -> None:
    raw = make_weights("q8_0", 1, 96, 256, rng, 0.1)
    w = cm.Weights(raw.data, "q8_0", 1, 96, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    with cm.Pool(1) as one, cm.Pool(3) as pool:
        assert pool.spin_us == pytest.approx(2000.0)
        pool.spin_us = 0.0
        assert pool.spin_us == 0.0
        pool.spin_us = -5.0  # clamped
        assert pool.spin_us == 0.0
        want = cm.linear(w, x, pool=one)
        for _ in range(3):  # the workers sleep between calls and must wake for each
            time.sleep(0.01)
            assert np.array_equal(cm.linear(w, x, pool=pool), want)


def test_prompt_torch_threads_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(TORCH_THREADS_ENV, raising=False)
    assert prefill_torch_threads() == 1
    monkeypatch.setenv(TORCH_THREADS_ENV, "4")
    assert prefill_torch_threads() == 4
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(TORCH_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=TORCH_THREADS_ENV):
            prefill_torch_threads()
