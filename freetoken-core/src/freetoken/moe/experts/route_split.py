"""A locked-fetch layer's split of a step's routes into CPU and locked (GPU-fetched) ones,
in one kernel launch.

Beside an expert cache, :class:`~freetoken.moe.experts.locked_fetch.LockedPlacement`
decides on the device, before each CPU layer hands its step to the CPU workers, which
missed routes (expert not resident) the GPU fetches: the first ``round(fraction * missed)``
in (token, k) order, at most ``max_fetch``. As torch ops that is a chain of about thirteen
small kernels (gather, compare, a cumulative sum of two kernels, a sum, floor, clamp, the
masks) on the critical path of every CPU layer of every decode step, each a launch's worth
of GPU time in a decode graph. Here one program reads the ids and the residency, ranks the
misses with a block-wide cumulative sum and writes both masks. The budget's float32
product and its + 0.5 are two roundings, as the torch ops and the host form
(:func:`~freetoken.moe.experts.locked_fetch.fetch_budget`) take them: the launch turns off
fused multiply-adds, which would round once and could move a budget by one route.

One program holds every route of the step: up to :data:`MAX_ROUTES` (a decode step has
``T x K`` of them, a few hundred at most; 4096 are 32 a thread in four warps); for a larger
step :func:`locked_split` declines and the caller takes the torch ops
(:func:`~freetoken.moe.experts.locked_fetch.locked_split_torch`), which compute the same.

triton is optional: import this module lazily, only where Triton runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from freetoken.backends import triton_target

#: most routes (tokens x top-k) the one program splits; more take the torch ops
MAX_ROUTES = 4096
#: smallest block a launch takes: the block sizes a session compiles (before graph capture)
#: are the powers of two from here to MAX_ROUTES
MIN_BLOCK = 128


@triton.jit(do_not_specialize=["n"])  # a variant per block size and id type (compiled before capture)
def _route_split_kernel(ids_ptr, resident_ptr, cpu_ptr, locked_ptr, n, fraction, max_fetch, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(ids_ptr + offs, mask=ok, other=-1)
    valid = e >= 0
    resident = tl.load(resident_ptr + tl.maximum(e, 0).to(tl.int64), mask=valid, other=1)
    miss = valid & (resident == 0)
    ones = miss.to(tl.int32)
    rank = tl.cumsum(ones, axis=0) - 1
    # as the torch ops round: the float32 product, then + 0.5 (no FMA: see the launch)
    budget = tl.minimum(tl.floor(tl.sum(ones, axis=0).to(tl.float32) * fraction + 0.5), max_fetch)
    locked = miss & (rank.to(tl.float32) < budget)
    tl.store(cpu_ptr + offs, miss & ~locked, mask=ok)
    tl.store(locked_ptr + offs, locked, mask=ok)


def launch_shape(routes: int) -> tuple[int, int]:
    """(block, warps) of the launch over ``routes``: the block a power of two, at least
    :data:`MIN_BLOCK`; one warp up to 512 routes (16 a thread), four above."""
    block = max(triton.next_power_of_2(routes), MIN_BLOCK)
    return block, 1 if block <= 512 else 4


def locked_split(ids: torch.Tensor, resident: torch.Tensor, fraction: float,
                 max_fetch: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(cpu mask, locked mask), bool ``[T, K]`` on ids' device: of the routes whose expert
    is not ``resident`` (``ids`` int32 or int64 ``[T, K]``, -1 = no route; ``resident``
    bool ``[num_experts]`` on the same device), the first ``floor(float32(missed) *
    float32(fraction) + 0.5)``, at most ``max_fetch``, in (token, k) order are locked, the
    others go to the CPU. One launch for up to :data:`MAX_ROUTES` routes, no host sync
    (captured in graphs); None for no route or more than that (the caller takes the torch
    ops)."""
    n = ids.numel()
    if not 0 < n <= MAX_ROUTES:
        return None
    cpu = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    locked = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    block, warps = launch_shape(n)
    opts = triton_target.for_device(ids.device).launch_options(warps, enable_fp_fusion=False)
    _route_split_kernel[(1,)](ids.contiguous(), resident, cpu, locked, n, float(fraction), float(max_fetch),
                              BLOCK=block, **opts)  # fmt: skip
    return cpu, locked
