"""Locked fetch's route choice: the device rule (LockedPlacement, captured in graphs), its
host mirror (used by the statistics) and the constants of a step without a cache
(first_routes) against a plain Python count; and the clear refusal where the GPU cannot
read the host banks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.moe.experts.locked_fetch import (
    FetchProfile,
    LockedPlacement,
    choose_fetch_routes,
    first_routes,
    locked_routes,
    planned_fraction,
)


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


@pytest.mark.parametrize("fraction,max_fetch", [(0.0, 2), (0.25, 2), (0.3, 8), (0.5, 1), (1.0, 64)])
def test_first_routes_are_the_rule_with_every_route_missed(fraction, max_fetch):
    """Copy mode without a cache: the CPU mask and the slots of a batch size are the locked
    rule's split when no expert is resident, whatever the ids; slot j is the j-th locked route."""
    g = torch.Generator().manual_seed(int(fraction * 100) + max_fetch)
    none = torch.zeros(16, dtype=torch.bool)
    for tokens in (1, 2, 3, 8):
        ids = torch.randint(0, 16, (tokens, 4), generator=g).to(torch.int32)
        n, cpu, slots = first_routes(tokens, 4, fraction, max_fetch)
        want_cpu, want_locked = expected(ids.numpy(), none.numpy(), fraction, max_fetch)
        assert (cpu.numpy() == want_cpu).all() and n == int(want_locked.sum())
        assert sorted(slots[torch.from_numpy(want_locked)].tolist()) == list(range(n))
        assert (slots[cpu] == -1).all()


def test_locked_fetch_refused_where_the_gpu_cannot_read_the_banks():
    registry.reset()
    with pytest.raises(ValueError, match="--moe-locked-fetch"):
        LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=64, kv_cache_tokens=256,
                               moe_cpu_layers="all", moe_locked_fetch=0.3))
    registry.reset()


def test_split_experts_add_cached_and_fetched_routes():
    """SplitGpuExperts: routes whose expert is resident go through the cache's pool, the other
    GPU routes through the fetched experts (here the torch implementation over the same weights),
    and the two add up to every route's float64 result; ``out`` is filled when given."""
    from test_expert_cache import E, H, I, K, layer

    from freetoken.moe.experts.copy_queue import CopyQueue
    from freetoken.moe.experts.expert_cache import ExpertCache
    from freetoken.moe.experts.gpu_experts import GpuExperts
    from freetoken.moe.experts.locked_fetch import SplitGpuExperts

    weights = {7: layer(11)}
    copies = CopyQueue("cpu")
    try:
        cache = ExpertCache(weights, 3 * (3 * H * I * 4), "cpu", torch.float32, "silu", packed_ok=False,
                            copies=copies)  # three slots: experts 0, 1, 2
        lw = weights[7]
        fetched = GpuExperts(lw.gate.data, lw.up.data, lw.down.data, impl="torch")
        split = SplitGpuExperts(cache.layer_experts(7), cache.resident[0], fetched, H)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(4, H, generator=g)
        ids = torch.randint(0, E, (4, K), generator=g).to(torch.int32)
        ids[0, 0], ids[1, 0] = 1, 6  # at least one cached and one fetched route
        ids[3, 1] = -1  # a route on the CPU
        w = torch.rand(4, K, generator=g)
        ref = torch.zeros(4, H, dtype=torch.float64)
        for t in range(4):
            for k in range(K):
                e = int(ids[t, k])
                if e >= 0:
                    xd = x[t].double()
                    h = torch.nn.functional.silu(lw.gate.data[e].double() @ xd) * (lw.up.data[e].double() @ xd)
                    ref[t] += float(w[t, k]) * (lw.down.data[e].double() @ h)
        got = split.forward(x, ids, w)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)
        out = torch.full((4, H), float("nan"))
        assert split.forward(x, ids, w, out=out) is out and torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    finally:
        copies.close()


def test_auto_share_only_where_measured():
    """``--moe-locked-fetch auto`` (None): the backend's measured share on a GPU whose layers
    can be fetched; off on a host device, on a backend without a measured share (ROCm) and for
    layers the GPU cannot fetch; a given share is kept as given (refusals where it cannot
    apply are the session's)."""
    assert planned_fraction(None, "cuda", True, 0.25) == (0.25, "auto")
    assert planned_fraction(None, "cuda", False, 0.25)[0] == 0.0
    assert planned_fraction(None, "cpu", True, 0.25) == (0.0, "auto: off on cpu")
    assert planned_fraction(0.4, "cpu", False, 0.0) == (0.4, "given")
    assert planned_fraction(0.0, "cuda", True, 0.25) == (0.0, "given")
    off, why = planned_fraction(None, "cuda", True, 0.0)
    assert off == 0.0 and "no measured share" in why


@pytest.mark.parametrize("step_us,want", [
    ({0: 100.0, 1: 80.0, 2: 79.0}, 1),  # a second route within 5% of the first: not worth its PCIe reads
    ({0: 100.0, 1: 90.0, 2: 70.0}, 2),
    ({0: 100.0, 1: 104.0, 2: 120.0}, 0),  # fetching only slows the step
    ({0: 104.0, 1: 100.0, 2: 120.0}, 0),  # none is within 5% of the best
    ({0: 200.0, 1: 150.0, 2: 151.0, 3: 100.0}, 3),
])
def test_fetch_count_chosen_from_the_measured_steps(step_us, want):
    """``auto``'s start-up choice: the fewest fetched routes whose measured step is within 5%
    of the shortest."""
    assert choose_fetch_routes(step_us) == want
    profile = FetchProfile({n: t for n, t in step_us.items()}, {n: t / 2 for n, t in step_us.items()})
    assert profile.step_us() == step_us and profile.as_dict()["routes"] == want


def test_backends_declare_their_share():
    """The NVIDIA backend declares the share measured there; the ROCm backend, the CPU
    backend and the contract's default declare none."""
    from freetoken.backends.contract import Backend

    assert Backend.locked_fetch_share == 0.0
    cuda = pytest.importorskip("freetoken_cuda.backend")
    rocm = pytest.importorskip("freetoken_rocm.backend")
    assert cuda.CudaBackend.locked_fetch_share == 0.25 and rocm.RocmBackend.locked_fetch_share == 0.0
