"""Locked fetch's route split in one kernel (``freetoken.moe.experts.route_split``): the CPU
and locked masks of a step against a numpy count of the missed routes and against the host
form (``locked_routes``), with freshly written outputs; the torch ops above the one-program
bound. In Triton's interpreter without a GPU; on the H200 also through LockedPlacement and a
CUDA graph. The kernel compiles for sm_90 and gfx942 with the budget's product and sum
rounded apart (no FMA), as the torch ops and the host form round them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.moe.experts import route_split as rs
from freetoken.moe.experts.locked_fetch import LockedPlacement, fetch_budget, locked_routes, locked_split_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS = 16
#: fresh inputs every run (the seed is in each failure's message)
BASE_SEED = random.SystemRandom().randrange(1 << 30)


def reference(ids: np.ndarray, resident: np.ndarray, fraction: float, max_fetch: int) -> tuple[np.ndarray, np.ndarray]:
    """(cpu, locked) by counting: the missed routes in (token, k) order, the first
    ``floor(float32(missed) * float32(fraction) + 0.5)`` (float32 steps), at most
    ``max_fetch``, locked."""
    missed = [i for i, e in enumerate(ids.reshape(-1).tolist()) if e >= 0 and not resident[e]]
    product = np.float32(len(missed)) * np.float32(fraction)
    n = min(int(np.floor(product + np.float32(0.5))), max_fetch)
    cpu = np.zeros(ids.size, dtype=bool)
    locked = np.zeros(ids.size, dtype=bool)
    for rank, i in enumerate(missed):
        (locked if rank < n else cpu)[i] = True
    return cpu.reshape(ids.shape), locked.reshape(ids.shape)


def _inputs(gen: torch.Generator, tokens: int, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(-1, EXPERTS, (tokens, top_k), generator=gen)
    ids[0, 0] = -1  # at least one skipped route
    resident = torch.rand(EXPERTS, generator=gen) < torch.rand(1, generator=gen)
    return ids.to(dtype), resident


def _check(ids: torch.Tensor, resident: torch.Tensor, fraction: float, max_fetch: int, cpu: torch.Tensor,
           locked: torch.Tensor) -> None:  # fmt: skip
    assert cpu.dtype == locked.dtype == torch.bool and cpu.shape == locked.shape == ids.shape
    want_cpu, want_locked = reference(ids.cpu().numpy(), resident.cpu().numpy(), fraction, max_fetch)
    case = (f"seed {BASE_SEED}: ids {ids.tolist()}, resident {resident.tolist()}, fraction {fraction}, "
            f"max_fetch {max_fetch}")
    assert np.array_equal(cpu.cpu().numpy(), want_cpu), case
    assert np.array_equal(locked.cpu().numpy(), want_locked), case
    host_ids = ids.cpu().numpy()
    miss = (host_ids >= 0) & ~resident.cpu().numpy()[np.maximum(host_ids, 0)]
    assert np.array_equal(locked_routes(miss, fraction, max_fetch), want_locked), case


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("top_k", [1, 4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 8, 33])
def test_split_matches_the_count(tokens, top_k, dtype):
    """Fresh ids (some -1) and residency for every fraction and fetch cap."""
    gen = torch.Generator().manual_seed(BASE_SEED + 1000 * tokens + 10 * top_k + (dtype == torch.int64))
    for fraction in (0.0, 0.25, 0.5, 1.0):
        for max_fetch in (0, 1, 2, 8):
            ids, resident = _inputs(gen, tokens, top_k, dtype)
            ids, resident = ids.to(DEV), resident.to(DEV)
            _check(ids, resident, fraction, max_fetch, *rs.locked_split(ids, resident, fraction, max_fetch))


@pytest.mark.parametrize("poison", [True, False])
def test_outputs_are_written_whole(poison, monkeypatch):
    """Every element of both masks is written: outputs allocated full of ``poison`` come
    back as the count says (a route left unwritten would keep it)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(poison)

    gen = torch.Generator().manual_seed(BASE_SEED + 7 + poison)
    monkeypatch.setattr(torch, "empty", poisoned)
    for tokens, top_k in ((1, 8), (3, 4), (33, 8)):
        ids, resident = _inputs(gen, tokens, top_k, torch.int32)
        ids, resident = ids.to(DEV), resident.to(DEV)
        _check(ids, resident, 0.5, 8, *rs.locked_split(ids, resident, 0.5, 8))


@pytest.mark.parametrize("missed,fraction,want", [(5, 0.5, 3), (3, 0.5, 2), (2, 0.25, 1), (1, 0.5, 1), (6, 0.25, 2)])
def test_budget_rounds_halves_up(missed, fraction, want):
    """``missed * fraction`` exactly on a half: rounded up (2.5 -> 3, not to the even 2)."""
    ids = torch.full((1, 8), -1, dtype=torch.int32)
    ids[0, :missed] = torch.arange(missed, dtype=torch.int32)
    resident = torch.zeros(EXPERTS, dtype=torch.bool)
    resident[missed:] = True  # the ids' experts missed, the others resident
    cpu, locked = rs.locked_split(ids.to(DEV), resident.to(DEV), fraction, 8)
    assert fetch_budget(missed, fraction, 8) == want
    assert locked.cpu()[0].tolist() == [True] * want + [False] * (8 - want)
    assert cpu.cpu()[0].tolist() == [False] * want + [True] * (missed - want) + [False] * (8 - missed)
    _check(ids, resident, fraction, 8, cpu, locked)


class _CountedKernel:
    """Stands in for the kernel: counts launches, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("tokens,top_k,launches", [(rs.MAX_ROUTES // 8, 8, 1), (rs.MAX_ROUTES // 8 + 1, 8, 0),
                                                   (rs.MAX_ROUTES + 3, 1, 0)])
def test_one_launch_up_to_the_bound_then_the_torch_ops(tokens, top_k, launches, monkeypatch):
    """Up to MAX_ROUTES routes one program splits them; above, the kernel declines and the
    torch ops split them (LockedPlacement's fallback), with the same masks."""
    counted = _CountedKernel(rs._route_split_kernel)
    monkeypatch.setattr(rs, "_route_split_kernel", counted)
    gen = torch.Generator().manual_seed(BASE_SEED + tokens * top_k)
    for fraction, max_fetch in ((0.5, 8), (0.25, 4096)):
        ids, resident = _inputs(gen, tokens, top_k, torch.int64)
        ids, resident = ids.to(DEV), resident.to(DEV)
        masks = rs.locked_split(ids, resident, fraction, max_fetch)
        assert (masks is None) == (launches == 0)
        if masks is None:
            masks = locked_split_torch(ids, resident, fraction, max_fetch)
        _check(ids, resident, fraction, max_fetch, *masks)
    assert counted.launches == 2 * launches


def test_launch_shapes():
    assert [rs.launch_shape(n) for n in (1, 128, 129, 512, 513, rs.MAX_ROUTES)] == [
        (128, 1), (128, 1), (256, 1), (512, 1), (1024, 4), (rs.MAX_ROUTES, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (LockedPlacement takes the kernel there)")
def test_locked_placement_splits_with_the_kernel_in_a_graph(monkeypatch):
    """On a GPU LockedPlacement.split is the kernel's one launch, and a captured split
    follows the ids of every replay."""
    counted = _CountedKernel(rs._route_split_kernel)
    monkeypatch.setattr(rs, "_route_split_kernel", counted)
    gen = torch.Generator().manual_seed(BASE_SEED + 11)
    ids, resident = _inputs(gen, 8, 8, torch.int32)
    ids, resident = ids.cuda(), resident.cuda()
    placement = LockedPlacement(resident, fraction=0.5, max_fetch=4)
    _check(ids, resident, 0.5, 4, *placement.split(ids))  # compiled before the capture
    assert counted.launches == 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cpu, locked = placement.split(ids)
    for _ in range(3):
        ids.copy_(_inputs(gen, 8, 8, torch.int32)[0])
        graph.replay()
        torch.cuda.synchronize()
        _check(ids, resident, 0.5, 4, cpu, locked)


_COMPILE_SCRIPT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.backends.triton_target import hip_target
from freetoken.moe.experts import route_split as rs
report = {}
shapes = sorted({rs.launch_shape(1 << i) for i in range(rs.MAX_ROUTES.bit_length())})
for arch in ("sm_90", "gfx942"):
    if arch == "gfx942":
        try:
            import triton.backends.amd  # noqa: F401
        except ImportError:
            continue
    for ids in ("i32", "i64"):
        for block, warps in shapes:
            sig = {"ids_ptr": f"*{ids}", "resident_ptr": "*i1", "cpu_ptr": "*i1", "locked_ptr": "*i1", "n": "i32",
                   "fraction": "fp32", "max_fetch": "fp32", "BLOCK": "constexpr"}
            if arch == "sm_90":
                target, opts = GPUTarget("cuda", 90, 32), dict(num_warps=warps, enable_fp_fusion=False)
            else:
                t = hip_target(arch)
                target, opts = t.compile_target(), t.launch_options(warps, enable_fp_fusion=False)
            k = triton.compile(ASTSource(rs._route_split_kernel, sig, {"BLOCK": block}, {}), target=target,
                               options=opts)
            asm = k.asm["ptx"] if arch == "sm_90" else k.asm["amdgcn"]
            report[f"{arch} {ids} {block}"] = {
                "binary": bool(k.asm.get("cubin") or k.asm.get("hsaco")),
                "fma": bool(re.search(r"fma\\.rn\\.f32|v_fma_f32|v_fmac_f32", asm))}
print(json.dumps(report))
"""


def test_split_compiles_for_sm90_and_gfx942_without_fma():
    """Every launch shape compiles for sm_90 (and gfx942 where Triton has its AMD backend),
    int32 and int64 ids, in a process without TRITON_INTERPRET; the budget's float32 product
    and + 0.5 stay two roundings (a fused multiply-add would round once and could move a
    budget across an integer)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(name.startswith("sm_90") for name in report) == 2 * 6, report
    assert all(info["binary"] and not info["fma"] for info in report.values()), report
