"""Copy the routed experts of a layer from mapped host banks into a device buffer, in one
kernel launch per expert stack, with the routed set read on the device.

The copy engine needs the host to know which experts to copy, so a prompt that streams
only its routed experts used to read the router's result back for every layer: the host
waits for the GPU, the GPU then waits for the host's copies and launches, and a 512-token
prompt through 48 streamed layers left the GPU idle most of the time. Here the GPU reads
the page-locked, mapped banks itself (PCIe reads by the SMs): program ``(e, c)`` copies
chunk ``c`` of expert ``e``'s bytes when ``counts[e] > 0`` and returns at once otherwise.
The launch goes on the compute stream after the router, so the host never waits and the
destination is never overwritten while an earlier kernel still reads it.

:func:`gather_routes` is the decode step's form: a few routes' experts copied into as many
staging slots (locked fetch by copy, :mod:`freetoken.moe.experts.locked_fetch`).

triton is optional: import this module lazily, only where Triton runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import triton
import triton.language as tl

from freetoken.backends import triton_target

#: bytes one program copies (16-byte vectors: 1024 per program with 4 warps x 8 each)
CHUNK_BYTES = 16384


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, counts_ptr, EXPERT_BYTES: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.program_id(0)
    if tl.load(counts_ptr + e) > 0:
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < EXPERT_BYTES
        base = e.to(tl.int64) * EXPERT_BYTES
        tl.store(dst_ptr + base + offs, tl.load(src_ptr + base + offs, mask=ok), mask=ok)


def gather_experts(src: Any, dst: Any, counts: Any, num_experts: int) -> None:
    """``dst[e] = src[e]`` for every expert ``e`` with ``counts[e] > 0``; the other experts'
    bytes of ``dst`` are left as they are.

    ``src``: the stack's bytes, ``num_experts`` equal parts, as a uint8 tensor or a pointer
    object Triton takes (``data_ptr()``, ``dtype`` uint8: a mapped host address); ``dst`` a
    uint8 device tensor of the same size; ``counts`` ``[num_experts]`` integers on the
    device (routes per expert)."""
    size = int(dst.numel())
    if size % num_experts:
        raise ValueError(f"{size} bytes do not split into {num_experts} equal experts")
    per = size // num_experts
    grid = (num_experts, triton.cdiv(per, CHUNK_BYTES))
    opts = triton_target.for_device(dst.device).launch_options(4, 1)
    _gather_kernel[grid](src, dst, counts, EXPERT_BYTES=per, CHUNK=CHUNK_BYTES, **opts)


@triton.jit
def _copy_route_chunk(src_ptr, dst_ptr, e, j, c, EXPERT_BYTES: tl.constexpr, CHUNK: tl.constexpr):
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < EXPERT_BYTES
    src = src_ptr + e.to(tl.int64) * EXPERT_BYTES
    tl.store(dst_ptr + j.to(tl.int64) * EXPERT_BYTES + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def _gather_routes_kernel(src0_ptr, dst0_ptr, src1_ptr, dst1_ptr, src2_ptr, dst2_ptr, experts_ptr,
                          B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, CHUNK: tl.constexpr):
    # program (j, c): chunk c of slot j, the chunks of stack 0 first, then stack 1's, then 2's
    j = tl.program_id(0)
    e = tl.load(experts_ptr + j)
    if e >= 0:
        c = tl.program_id(1)
        n0: tl.constexpr = (B0 + CHUNK - 1) // CHUNK
        n1: tl.constexpr = (B1 + CHUNK - 1) // CHUNK
        if c < n0:
            _copy_route_chunk(src0_ptr, dst0_ptr, e, j, c, B0, CHUNK)
        elif c < n0 + n1:
            _copy_route_chunk(src1_ptr, dst1_ptr, e, j, c - n0, B1, CHUNK)
        else:
            _copy_route_chunk(src2_ptr, dst2_ptr, e, j, c - n0 - n1, B2, CHUNK)


def gather_routes(srcs: Sequence[Any], dsts: Sequence[Any], experts: Any, count: int,
                  expert_bytes: Sequence[int]) -> None:  # fmt: skip
    """``dsts[s][j] = srcs[s][experts[j]]`` for every stack ``s`` (one to three: a layer's
    gate, up and down) and ``j < count``, ``expert_bytes[s]`` each; slots whose
    ``experts[j]`` is negative are left as they are. One launch for all the stacks, the
    expert ids read on the device: a decode step's fetched routes copied into a few staging
    slots, every stack's reads in flight at once.

    ``srcs[s]``: a stack of experts of ``expert_bytes[s]`` each (uint8 tensor, or a pointer
    object as for :func:`gather_experts`); ``dsts[s]``: uint8 device tensor of at least
    ``count`` slots; ``experts``: int32 (or int64) device tensor of at least ``count`` ids."""
    if not 1 <= len(srcs) == len(dsts) == len(expert_bytes) <= 3:
        raise ValueError(f"gather_routes takes one to three stacks, each with a source, a destination and a size; "
                         f"got {len(srcs)} sources, {len(dsts)} destinations, {len(expert_bytes)} sizes")
    if count <= 0:
        return
    for dst, per in zip(dsts, expert_bytes):
        if int(dst.numel()) < count * per:
            raise ValueError(f"{dst.numel()} staging bytes hold fewer than {count} experts of {per} bytes")
    sizes = [int(b) for b in expert_bytes] + [0] * (3 - len(expert_bytes))
    pairs = [(s, d) for s, d in zip(srcs, dsts)]
    pairs += [pairs[0]] * (3 - len(pairs))  # (never read: their stacks have no chunks)
    chunks = sum(triton.cdiv(b, CHUNK_BYTES) for b in sizes)
    opts = triton_target.for_device(dsts[0].device).launch_options(4, 1)
    _gather_routes_kernel[(count, chunks)](pairs[0][0], pairs[0][1], pairs[1][0], pairs[1][1], pairs[2][0],
                                           pairs[2][1], experts, B0=sizes[0], B1=sizes[1], B2=sizes[2],
                                           CHUNK=CHUNK_BYTES, **opts)  # fmt: skip
