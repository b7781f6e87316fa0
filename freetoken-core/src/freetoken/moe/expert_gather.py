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
staging slots (locked fetch by copy, :mod:`freetoken.moe.locked_fetch`).

triton is optional: import this module lazily, only where Triton runs.
"""

from __future__ import annotations

from typing import Any

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
def _gather_routes_kernel(src_ptr, dst_ptr, experts_ptr, EXPERT_BYTES: tl.constexpr, CHUNK: tl.constexpr):
    j = tl.program_id(0)
    e = tl.load(experts_ptr + j)
    if e >= 0:
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < EXPERT_BYTES
        src = src_ptr + e.to(tl.int64) * EXPERT_BYTES
        tl.store(dst_ptr + j.to(tl.int64) * EXPERT_BYTES + offs, tl.load(src + offs, mask=ok), mask=ok)


def gather_routes(src: Any, dst: Any, experts: Any, count: int, expert_bytes: int) -> None:
    """``dst[j] = src[experts[j]]`` for ``j < count`` (``expert_bytes`` each); slots whose
    ``experts[j]`` is negative are left as they are. One launch, the expert ids read on the
    device: a decode step's fetched routes copied into a few staging slots.

    ``src``: a stack of experts of ``expert_bytes`` each (uint8 tensor, or a pointer object as
    for :func:`gather_experts`); ``dst``: uint8 device tensor of at least ``count`` slots;
    ``experts``: int32 (or int64) device tensor of at least ``count`` expert ids."""
    if count <= 0:
        return
    if int(dst.numel()) < count * expert_bytes:
        raise ValueError(f"{dst.numel()} staging bytes hold fewer than {count} experts of {expert_bytes} bytes")
    grid = (count, triton.cdiv(expert_bytes, CHUNK_BYTES))
    opts = triton_target.for_device(dst.device).launch_options(4, 1)
    _gather_routes_kernel[grid](src, dst, experts, EXPERT_BYTES=expert_bytes, CHUNK=CHUNK_BYTES, **opts)
