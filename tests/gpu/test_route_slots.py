"""A cached layer's routes as cache slots (``freetoken.moe.experts.route_slots``): the Triton
kernel (interpreter without a GPU, compiled on the H200) against a Python loop."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import route_slots
from freetoken.moe.experts.route_slots import _torch_slots

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,top_k,dtype", [(1, 8, torch.int32), (3, 4, torch.int64), (40, 8, torch.int32)])
def test_route_slots_kernel_maps_ids_through_the_table(tokens, top_k, dtype):
    gen = torch.Generator().manual_seed(tokens * top_k)
    num_experts = 64
    table = torch.randint(-1, 500, (num_experts,), generator=gen, dtype=torch.int32)  # -1: not cached
    ids = torch.randint(-1, num_experts, (tokens, top_k), generator=gen).to(dtype)
    want = [[-1 if e < 0 else int(table[e]) for e in row] for row in ids.tolist()]
    out = torch.full((tokens, top_k), 12345, dtype=torch.int32, device=DEV)  # poisoned
    route_slots.launch(ids.to(DEV), table.to(DEV), out)
    assert out.cpu().tolist() == want
    assert _torch_slots(ids, table).tolist() == want  # the host device's torch form
