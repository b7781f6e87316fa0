"""A cached layer's routes as cache slots, in one kernel.

The expert cache keeps, per layer, a device table ``slot[expert]`` (``-1``: not cached).
A decode step's GPU side needs every route's slot, ``-1`` for a route to an expert that is
not cached (the CPU takes it) or for a skipped route (id ``-1``). As torch ops that is a
chain of five small kernels (compare, clamp, widen, gather, select) on top of the
placement's own mask and split (another five); in a decode graph each of them costs a
launch's worth of GPU time per layer. Where Triton runs this is one kernel; elsewhere (the
fake GPU plugin's host "device") the torch ops compute the same. A packed pool's per-route
kernels need neither: they read the table themselves
(:func:`freetoken.kernels.moe_packed.launch`'s ``table``).
"""

from __future__ import annotations

import torch


def _torch_slots(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return torch.where(ids >= 0, table[ids.clamp(min=0).long()], -1).to(torch.int32)


def route_slots(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, K]``: ``table[ids]`` where ``ids >= 0``, else ``-1`` (``table``: int32
    ``[num_experts]`` on ids' device)."""
    from freetoken.backends import triton_target

    if ids.device.type == "cpu" or not triton_target.for_device(ids.device).usable:
        return _torch_slots(ids, table)
    from freetoken.kernels.route_slots import launch

    out = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    launch(ids.contiguous(), table, out)
    return out

