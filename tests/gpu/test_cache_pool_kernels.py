"""The expert cache's pool kernels (freetoken.moe.experts.expert_cache over packed GGUF blocks):
a cached layer's routes computed from its slots, with routes to experts the cache does not
hold skipped, against gguf-py's float64 dequantization, for a decode-sized batch (the
per-route kernels) and a prompt-sized one (the grouped kernels). Runs compiled on the GPU
machine, in Triton's interpreter elsewhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("gguf")

from expert_reference import reference_experts  # noqa: E402
from test_grouped_experts import TOL as GROUPED_TOL  # noqa: E402
from test_packed_experts import (  # noqa: E402
    DEV, FP32_TOL, INT8_TOL, INTERPRET, Q4, Q6, WIDE, check_rows, int8_rounding, random_layer,
)

from freetoken.kernels import moe_packed  # noqa: E402
from freetoken.moe.experts.copy_queue import CopyQueue  # noqa: E402
from freetoken.moe.experts.expert_cache import ExpertCache  # noqa: E402
from freetoken.models.moe_layer import ExpertWeights  # noqa: E402


@pytest.mark.parametrize("tokens", [2, 34])
def test_cached_layer_routes_match_gguf_reference(tokens, monkeypatch):
    if INTERPRET:  # one program per route and token in the interpreter (its cost is per program)
        monkeypatch.setattr(moe_packed, "DEFAULT_CONFIG",
                            dataclasses.replace(WIDE, max_routes=moe_packed.DEFAULT_CONFIG.max_routes))
    layers, refs = {}, {}
    for i, seed in enumerate((31, 32)):
        (gate, up, down), ref = random_layer((Q4, Q4, Q6), seed)
        layers[10 + i] = ExpertWeights(gate, up, down, num_experts=gate.shape[0], hidden=gate.shape[2],
                                       intermediate=gate.shape[1])
        refs[10 + i] = ref
    e = layers[10]
    copies = CopyQueue(DEV)
    try:
        cache = ExpertCache(layers, 7 * e.bytes_per_expert, DEV, torch.bfloat16, "silu", packed_ok=True,
                            copies=copies)
        copies.submit([]).order_before()
        assert cache.slots == 7 and len(cache.pools) == 1 and cache.pools[0].packed
        gen = torch.Generator().manual_seed(tokens)
        for layer in (11,):  # the second row of the tables (the first holds experts too)
            g64, u64, d64 = refs[layer]
            row = cache.rows[layer]
            held = torch.from_numpy(cache.host_slot[row] >= 0)
            assert 0 < int(held.sum()) < e.num_experts  # some routes hit, some are skipped
            x = torch.randn(tokens, e.hidden, generator=gen)
            ids = torch.randint(0, e.num_experts, (tokens, 8), generator=gen).to(torch.int32)
            ids[torch.rand(tokens, 8, generator=gen) < 0.2] = -1
            w = torch.rand(tokens, 8, generator=gen) + 0.1
            out = cache.layer_experts(layer).forward_routes(x.to(DEV), ids.to(DEV), w.to(DEV))
            gpu_ids = torch.where((ids >= 0) & held[ids.clamp(min=0).long()], ids, torch.full_like(ids, -1))
            pool = cache.pools[0].experts
            grouped = tokens * 8 > pool.config.max_routes
            assert grouped == (tokens > 2)
            # the per-route kernels with the device's default tiles (NVIDIA: int8 dots, which
            # round the activations); the grouped kernels multiply BF16 activations and weights
            # (their own tests' bound)
            rounding = {} if grouped else int8_rounding(pool.config, (Q4, Q4, Q6))
            want = reference_experts(x, gpu_ids, w, g64, u64, d64, **rounding)
            check_rows(out.float(), want, GROUPED_TOL if grouped else (INT8_TOL if rounding else FP32_TOL * 10))
    finally:
        copies.close()
