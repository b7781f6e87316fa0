"""The routed-expert gather kernels (``freetoken.moe.experts.expert_gather``): the experts with
routes copied byte for byte, the others' destination bytes untouched; a step's fetched
routes copied into their slots. In Triton's interpreter without a GPU; on the H200 also
from page-locked host memory read in place."""

from __future__ import annotations

import pytest
import torch

from freetoken.moe.experts.expert_gather import CHUNK_BYTES, gather_experts, gather_routes
from freetoken.moe.experts.locked_fetch import DevicePointer

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_experts: int, per: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (num_experts * per,), generator=gen, dtype=torch.uint8)
    counts = torch.randint(0, 3, (num_experts,), generator=gen, dtype=torch.int32)
    counts[0], counts[-1] = 1, 0  # at least one expert copied, one left alone
    poison = torch.randint(0, 256, (num_experts * per,), generator=gen, dtype=torch.uint8)
    return src, counts, poison


def _expected(src: torch.Tensor, counts: torch.Tensor, poison: torch.Tensor, per: int) -> torch.Tensor:
    want = poison.clone().view(-1, per)
    used = counts > 0
    want[used] = src.view(-1, per)[used]
    return want.reshape(-1)


# expert sizes: below one chunk, a chunk and a ragged tail, an odd byte count
@pytest.mark.parametrize("num_experts,per", [(5, 1000), (4, CHUNK_BYTES + 4112), (3, 2 * CHUNK_BYTES + 7)])
def test_gather_copies_the_routed_experts_only(num_experts, per):
    src, counts, poison = _case(num_experts, per, seed=per)
    dst = poison.to(DEV)
    gather_experts(src.to(DEV), dst, counts.to(DEV), num_experts)
    assert torch.equal(dst.cpu(), _expected(src, counts, poison, per))


def test_gather_refuses_unequal_experts():
    with pytest.raises(ValueError, match="equal experts"):
        gather_experts(torch.zeros(10, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8),
                       torch.ones(3, dtype=torch.int32), 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (page-locked host memory read in place)")
def test_gather_reads_page_locked_host_memory_in_place():
    num_experts, per = 16, 3 * CHUNK_BYTES + 96
    src, counts, poison = _case(num_experts, per, seed=7)
    host = src.pin_memory()  # page-locked and, with unified addressing, mapped at the same address
    dst = poison.to("cuda")
    gather_experts(DevicePointer(host.data_ptr(), torch.uint8), dst, counts.to("cuda"), num_experts)
    assert torch.equal(dst.cpu(), _expected(src, counts, poison, per))


@pytest.mark.parametrize("pers,count", [((1000,), 3), ((CHUNK_BYTES + 4112, 700), 2),
                                        ((2 * CHUNK_BYTES + 7, CHUNK_BYTES, 3 * CHUNK_BYTES + 33), 4)])
def test_gather_routes_fills_the_slots(pers, count):
    """For every stack (one to three, of different expert sizes, in one launch) slot j gets
    expert ``experts[j]``'s bytes for j < count; a slot whose expert is -1 and the slots past
    ``count`` keep their bytes."""
    num_experts, slots = 9, 5
    gen = torch.Generator().manual_seed(sum(pers) + count)
    srcs = [torch.randint(0, 256, (num_experts * per,), generator=gen, dtype=torch.uint8) for per in pers]
    poisons = [torch.randint(0, 256, (slots * per,), generator=gen, dtype=torch.uint8) for per in pers]
    experts = torch.randperm(num_experts, generator=gen)[:slots].to(torch.int32)
    experts[1] = -1
    dsts = [p.to(DEV) for p in poisons]
    gather_routes([s.to(DEV) for s in srcs], dsts, experts.to(DEV), count, pers)
    for src, dst, poison, per in zip(srcs, dsts, poisons, pers):
        want = poison.clone().view(slots, per)
        for j in range(count):
            if experts[j] >= 0:
                want[j] = src.view(num_experts, per)[experts[j]]
        assert torch.equal(dst.cpu(), want.reshape(-1))


def test_gather_routes_refuses_too_few_slots_and_bad_stacks():
    z = torch.zeros(40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fewer than 3 experts"):
        gather_routes([z, z], [z, torch.zeros(20, dtype=torch.uint8)], torch.zeros(3, dtype=torch.int32), 3, [10, 10])
    with pytest.raises(ValueError, match="one to three stacks"):
        gather_routes([z] * 4, [z] * 4, torch.zeros(3, dtype=torch.int32), 1, [10] * 4)
    with pytest.raises(ValueError, match="one to three stacks"):
        gather_routes([z, z], [z], torch.zeros(3, dtype=torch.int32), 1, [10, 10])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (page-locked host memory read in place)")
def test_gather_routes_reads_page_locked_host_memory():
    num_experts, pers = 12, (2 * CHUNK_BYTES + 48, CHUNK_BYTES - 16, 3 * CHUNK_BYTES)
    srcs = [torch.randint(0, 256, (num_experts * per,), dtype=torch.uint8) for per in pers]
    hosts = [s.pin_memory() for s in srcs]
    experts = torch.tensor([7, 2, 11], dtype=torch.int32)
    dsts = [torch.randint(0, 256, (3 * per,), dtype=torch.uint8, device="cuda") for per in pers]
    gather_routes([DevicePointer(h.data_ptr(), torch.uint8) for h in hosts], dsts, experts.cuda(), 3, pers)
    for src, dst, per in zip(srcs, dsts, pers):
        assert torch.equal(dst.cpu(), src.view(num_experts, per)[experts.long()].reshape(-1))


_SM90_SCRIPT = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import dense_ops as dot
from freetoken.moe.experts import expert_gather as eg
from freetoken.kernels import route_slots as rs
target, report = GPUTarget("cuda", 90, 32), {}
for name, fn, sig, consts in (
    ("router_logits", dot._router_logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
     {"H": 2048, "E": 128, "BLOCK_E": dot.ROUTER_BLOCK_E, "BLOCK_H": 512}),
    ("gather", eg._gather_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8", "counts_ptr": "*i32"},
     {"EXPERT_BYTES": 884736, "CHUNK": eg.CHUNK_BYTES}),
    ("gather_routes", eg._gather_routes_kernel, {**{f"{k}{s}_ptr": "*u8" for s in range(3) for k in ("src", "dst")},
                                                 "experts_ptr": "*i32"},
     {"B0": 884736, "B1": 884736, "B2": 1290240, "CHUNK": eg.CHUNK_BYTES}),
    ("route_slots", rs._route_slots_kernel, {"ids_ptr": "*i64", "table_ptr": "*i32", "out_ptr": "*i32", "n": "i32"},
     {"BLOCK": rs.BLOCK}),
):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options={"num_warps": 4})
    report[name] = {"cubin": bool(k.asm.get("cubin")), "vector_loads": "ld.global.v4" in k.asm["ptx"]}
print(json.dumps(report))
"""


def test_gather_slot_and_router_kernels_compile_for_sm90():
    """The gather, route-slot and router GEMV kernels compile for the H200 (sm_90) without a
    GPU (a subprocess without TRITON_INTERPRET); the gathers move 16-byte vectors."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(info["cubin"] for info in report.values()) and len(report) == 4, report
    assert report["gather"]["vector_loads"] and report["gather_routes"]["vector_loads"], report
