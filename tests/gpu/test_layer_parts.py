"""CPU-runnable checks of the hybrid layer's parts: placement and the GPU-expert math
(run on CPU tensors here) against the float64 per-route reference."""

from __future__ import annotations

import pytest
import torch

from expert_reference import random_experts, reference_experts

from freetoken.moe.experts.gpu_experts import GpuExperts
from freetoken.moe.placement import Placement, split_routes


def test_placement_by_residency_and_split():
    p = Placement.from_cpu_experts(8, [2, 5], "cpu")
    ids = torch.tensor([[0, 2, 5, 7], [5, 1, 2, 3]], dtype=torch.int64)
    mask = p.cpu_mask(ids)
    assert mask.tolist() == [[False, True, True, False], [True, False, True, False]]
    gpu_ids, cpu_ids = split_routes(ids, mask)
    assert gpu_ids.dtype == torch.int32 and cpu_ids.dtype == torch.int32
    assert gpu_ids.tolist() == [[0, -1, -1, 7], [-1, 1, -1, 3]]
    assert cpu_ids.tolist() == [[-1, 2, 5, -1], [5, -1, 2, -1]]


def test_placement_last_routes_per_token():
    p = Placement.all_gpu(8, "cpu")
    p.cpu_routes_per_token = 1
    ids = torch.randint(0, 8, (3, 4))
    assert p.cpu_mask(ids).tolist() == [[False, False, False, True]] * 3
    p.cpu_routes_per_token = 5
    with pytest.raises(ValueError, match="cpu_routes_per_token"):
        p.cpu_mask(ids)
    with pytest.raises(ValueError, match="outside"):
        Placement.from_cpu_experts(4, [4], "cpu")


@pytest.mark.parametrize("tokens", [1, 2, 9])  # gather path (T*K <= E) and dense path
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_gpu_experts_match_reference(tokens, activation):
    gen = torch.Generator().manual_seed(1234 + tokens)
    gate, up, down = random_experts(8, 64, 32, torch.float32, "cpu", gen)
    experts = GpuExperts(gate, up, down, activation)
    x = torch.randn(tokens, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(tokens)]).to(torch.int32)
    ids[torch.rand(tokens, 4, generator=gen) < 0.3] = -1  # routes served elsewhere
    w = torch.rand(tokens, 4, generator=gen)
    out = torch.full((tokens, 64), float("nan"))
    experts.forward(x, ids, w, out=out)
    ref = reference_experts(x, ids, w, gate, up, down, activation)
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_gpu_experts_reject_bad_shapes():
    gate, up, down = random_experts(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="expert shapes"):
        GpuExperts(gate, up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="activation"):
        GpuExperts(gate, up, down, "relu")
