"""Locked fetch: some of a step's missed experts read by the GPU straight from page-locked
host memory, in the same step, while the CPU workers compute the others.

A decode step's missed experts (routes of a CPU layer whose expert is not in the cache)
are normally all computed by the CPU workers, whose speed is the host's memory bandwidth.
The PCIe link is a second, independent path to the same bytes: with the banks page-locked
and mapped for the device (:class:`~freetoken.moe.host_pinning.HostRegistration`), the
packed expert kernels read a missed expert's blocks over PCIe directly (no copy, no staging
buffer: the weights never change, so there is nothing to order), and the CPU gets fewer
experts. :class:`LockedPlacement` decides per step, on the device (captured in graphs):
of the layer's missed routes, the first ``round(fraction * missed)`` -- at most
``max_fetch`` -- run on the GPU from host memory, the rest on the CPU. The best fraction is
about PCIe bandwidth / (PCIe + host memory bandwidth).

:class:`SplitGpuExperts` is then the layer's GPU side: cached routes through the cache's
pool, locked routes through the mapped banks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from freetoken.moe.gpu_packed_experts import PACKED_FORMATS
from freetoken.moe.placement import Placement

log = logging.getLogger(__name__)


class DevicePointer:
    """A device address with an element type, taken by Triton as a pointer argument."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = int(address)
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def mapped_stack(raw: Any, address: int) -> Any:
    """A :class:`~freetoken.moe.triton_moe_packed.PackedStack` whose bytes are read from the
    mapped host address ``address`` (the stack ``raw``'s first byte)."""
    from freetoken.moe import triton_moe_packed as tp

    @dataclasses.dataclass(frozen=True)
    class MappedStack(tp.PackedStack):
        address: int = 0
        size: int = 0
        experts: int = 0

        @property
        def nbytes(self) -> int:
            return self.size

        @property
        def num_experts(self) -> int:
            return self.experts

        def views(self) -> tuple[Any, Any, Any]:
            return tuple(DevicePointer(self.address, dt) for dt in (torch.uint8, torch.int8, torch.float16))

    e, rows, cols = (int(s) for s in raw.shape)
    return MappedStack(None, int(raw.fmt), rows, cols, address, int(raw.nbytes), e)


def locked_fetch_supported(experts: Any) -> bool:
    return {int(t.fmt) for t in (experts.gate, experts.up, experts.down)} <= PACKED_FORMATS


def mapped_experts(experts: Any, registration: Any, device: Any, activation: str, prompts: bool = False) -> Any:
    """One layer's experts as packed kernels over its mapped host banks. Decode batches
    (``prompts`` False) run the per-route kernels whatever their size; with ``prompts``,
    batches above the per-route sizes run the grouped kernels (each routed expert's blocks
    read about once per block of its routes). Nothing is ever dequantized from host memory."""
    import dataclasses as dc

    from freetoken.moe import triton_moe_packed as tp
    from freetoken.moe.gpu_packed_experts import PackedGpuExperts

    stacks = tuple(mapped_stack(t, registration.device_address(t.raw_torch())) for t in
                   (experts.gate, experts.up, experts.down))  # fmt: skip
    base = tp.default_config(device)
    config = base if prompts else dc.replace(base, max_routes=1 << 30)
    return PackedGpuExperts.over_device_bytes(experts, stacks, device, activation=activation, config=config,
                                              large_batch="grouped")


@dataclasses.dataclass
class LockedPlacement(Placement):
    """CPU routes = missed routes (expert not ``resident``) minus the locked ones: the first
    ``round(fraction * missed)`` missed routes in (token, k) order, at most ``max_fetch``."""

    fraction: float = 0.0
    max_fetch: int = 0
    explicit_mask: ClassVar[bool] = True

    def cpu_mask(self, ids: Any) -> Any:
        return self.split(ids)[0]

    def split(self, ids: Any) -> tuple[Any, Any]:
        """(cpu mask, locked mask), bool ``[T, K]``, computed on the device."""
        valid = ids >= 0
        miss = valid & ~self.resident[ids.clamp(min=0).long()]
        flat = miss.reshape(-1)
        rank = torch.cumsum(flat.to(torch.int32), 0) - 1
        budget = torch.clamp(torch.floor(flat.sum().to(torch.float32) * self.fraction + 0.5), max=self.max_fetch)
        locked = flat & (rank < budget)
        return (flat & ~locked).reshape(ids.shape), locked.reshape(ids.shape)


def locked_routes(miss: np.ndarray, fraction: float, max_fetch: int) -> np.ndarray:
    """Host form of :meth:`LockedPlacement.split`'s locked mask, for one layer's ``miss [T, K]``."""
    flat = miss.reshape(-1)
    rank = np.cumsum(flat) - 1
    budget = min(float(np.floor(np.float32(flat.sum()) * np.float32(fraction) + np.float32(0.5))), max_fetch)
    return (flat & (rank < budget)).reshape(miss.shape)


class SplitGpuExperts:
    """A CPU layer's GPU side with locked fetch: routes to cached experts through the cache
    (``cached``, or none), the other GPU routes through the mapped host banks."""

    def __init__(self, cached: Optional[Any], resident: Any, mapped: Any, hidden: int) -> None:
        self.cached, self.resident, self.mapped, self.hidden = cached, resident, mapped, hidden

    def forward(self, x: torch.Tensor, gpu_ids: torch.Tensor, w: torch.Tensor, out: Any = None) -> torch.Tensor:
        from freetoken.moe.gpu_experts import finish_output, float32_output

        if self.cached is None:
            return self.mapped.forward(x, gpu_ids, w, out)
        valid = gpu_ids >= 0
        minus = torch.full_like(gpu_ids, -1)
        hit = valid & self.resident[gpu_ids.clamp(min=0).long()]
        y, direct = float32_output(out, x, x.shape[0], self.hidden, x.device)
        self.cached.forward(x, torch.where(hit, gpu_ids, minus), w, out=y)
        y.add_(self.mapped.forward(x, torch.where(valid & ~hit, gpu_ids, minus), w, out=torch.empty_like(y)))
        return finish_output(y, out, direct, x.dtype)

    def warmup(self, batch_sizes: Any, top_k: int, x_dtype: Any = None) -> None:
        if self.cached is not None:
            self.cached.warmup(batch_sizes, top_k, x_dtype)
        self.mapped.warmup(batch_sizes, top_k, x_dtype)
