"""The Triton kernel of :func:`freetoken.moe.experts.route_slots.route_slots` (import lazily: triton
is optional)."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from freetoken.backends import triton_target

#: routes per program (a decode step has T x K of them: one program up to 16 tokens of 8)
BLOCK = 128


@triton.jit(do_not_specialize=["n"])  # one variant for every batch size (compiled before graph capture)
def _route_slots_kernel(ids_ptr, table_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int64)
    slot = tl.load(table_ptr + tl.maximum(e, 0), mask=ok & (e >= 0), other=-1)
    tl.store(out_ptr + offs, slot.to(tl.int32), mask=ok)


def launch(ids: Any, table: Any, out: Any) -> None:
    """``out[i] = table[ids[i]]`` where ``ids[i] >= 0``, else -1 (contiguous tensors)."""
    n = ids.numel()
    if n == 0:
        return
    opts = triton_target.for_device(ids.device).launch_options(4)
    _route_slots_kernel[(triton.cdiv(n, BLOCK),)](ids, table, out, n, BLOCK=BLOCK, **opts)
