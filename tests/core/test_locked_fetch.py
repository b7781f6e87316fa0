"""Locked fetch's route choice: the device rule (LockedPlacement, captured in graphs) and its
host mirror (used by the statistics) against a plain Python count; and the clear refusal
where the GPU cannot read the host banks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.moe.locked_fetch import LockedPlacement, locked_routes


def expected(ids: np.ndarray, resident: np.ndarray, fraction: float, max_fetch: int) -> tuple[np.ndarray, np.ndarray]:
    miss = [(t, k) for t in range(ids.shape[0]) for k in range(ids.shape[1]) if not resident[ids[t, k]]]
    n = min(int(np.floor(np.float32(len(miss)) * np.float32(fraction) + np.float32(0.5))), max_fetch)
    locked = np.zeros(ids.shape, dtype=bool)
    cpu = np.zeros(ids.shape, dtype=bool)
    for i, (t, k) in enumerate(miss):
        (locked if i < n else cpu)[t, k] = True
    return cpu, locked


@pytest.mark.parametrize("fraction,max_fetch", [(0.0, 2), (0.3, 2), (0.3, 8), (0.5, 1), (1.0, 64)])
def test_locked_choice_device_and_host(fraction, max_fetch):
    g = torch.Generator().manual_seed(int(fraction * 10) + max_fetch)
    for tokens in (1, 3, 8):
        ids = torch.randint(0, 16, (tokens, 4), generator=g).to(torch.int32)
        resident = torch.rand(16, generator=g) < 0.4
        cpu, locked = LockedPlacement(resident, fraction=fraction, max_fetch=max_fetch).split(ids)
        want_cpu, want_locked = expected(ids.numpy(), resident.numpy(), fraction, max_fetch)
        assert (cpu.numpy() == want_cpu).all() and (locked.numpy() == want_locked).all()
        miss = ~resident.numpy()[ids.numpy()]
        assert (locked_routes(miss, fraction, max_fetch) == want_locked).all()
        assert not (cpu & locked).any() and not (locked & resident[ids.long()]).any()


def test_locked_fetch_refused_where_the_gpu_cannot_read_the_banks():
    registry.reset()
    with pytest.raises(ValueError, match="--moe-locked-fetch"):
        LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=64, kv_cache_tokens=256,
                               moe_cpu_layers="all", moe_locked_fetch=0.3))
    registry.reset()
