"""Locked fetch: some of a step's missed experts read by the GPU from page-locked host
memory, in the same step, while the CPU workers compute the others.

A decode step's missed experts (routes of a CPU layer whose expert is not in the cache)
are normally all computed by the CPU workers, whose speed is the host's memory bandwidth.
The PCIe link is a second, independent path to the same bytes: with the banks page-locked
and mapped for the device (:class:`~freetoken.moe.handoff.host_pinning.HostRegistration`), one
gather kernel copies the locked routes' experts (their gate, up and down blocks) into a few
device staging slots (:class:`FetchStaging`, shared by every CPU layer: the layers run one
after another on one stream), wide 16-byte reads that keep many requests in flight, and the
packed kernels (the backend's native ones where it has them) then compute from the slots
(:class:`StagedFetch`); the CPU gets fewer experts. The best fraction is about PCIe
bandwidth / (PCIe + host memory bandwidth).

Without an expert cache every route of a CPU layer is missed, so the locked routes are the
first ``round(fraction * missed)`` -- at most ``max_fetch`` -- of the step in (token, k)
order, known from the batch size alone: the masks and slot ids are constants of each batch
size (:class:`FirstRoutesPlacement`), and a step costs the gather launch and the expert
kernels, nothing else on the GPU. Beside a cache, :class:`LockedPlacement` decides per step,
on the device (captured in graphs; one kernel where Triton runs,
:mod:`~freetoken.moe.experts.route_split`): of the layer's missed routes (expert not cached),
the first ``round(fraction * missed)``, at most ``max_fetch``, run on the GPU, the rest on
the CPU; :class:`SplitGpuExperts` is then the layer's GPU side: cached routes through the
cache's pool, locked routes through the slots.

(Having the packed kernels read the locked routes' blocks in place over PCIe, with no copy,
measured slower than leaving those routes to the CPU on the H200: docs/benchmarks.md, first
and eighth runs.)
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from freetoken.backends import triton_target
from freetoken.backends.contract import on_gpu
from freetoken.moe.experts.gpu_packed_experts import PACKED_FORMATS
from freetoken.moe.experts.routed import GpuRoutedExperts
from freetoken.moe.placement import Placement

log = logging.getLogger(__name__)


class DevicePointer:
    """A device address with an element type, taken by Triton as a pointer argument."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = int(address)
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def planned_fraction(fraction: Optional[float], device: Any, eligible: bool, auto_share: float) -> tuple[float, str]:
    """The locked-fetch share a session plans with, and why: ``fraction`` as given, or for
    ``auto`` (None) the backend's ``auto_share`` (:attr:`Backend.locked_fetch_share
    <freetoken.backends.contract.Backend.locked_fetch_share>`, 0 where it was not measured)
    where the layers' experts can be fetched (``eligible``: GGUF formats the packed kernels
    read, Triton on the device, banks that may be page-locked) on a GPU."""
    if fraction is not None:
        return float(fraction), "given"
    if not on_gpu(device):
        return 0.0, f"auto: off on {torch.device(device).type}"
    if auto_share <= 0:
        return 0.0, "auto: off on this backend (no measured share; give a fraction to use it)"
    if not eligible:
        return 0.0, ("auto: off (the CPU layers' experts are not in formats the GPU reads as stored, "
                     "or --moe-lock-host off)")
    return float(auto_share), "auto"


#: start-up trials of each candidate route count (fresh random experts each)
FETCH_TRIALS = 7
#: a count is chosen over a smaller one only when its measured step is shorter by more than
#: this share (fewer fetched routes: less PCIe traffic beside the CPU's reads)
FETCH_GAIN = 0.05


@dataclasses.dataclass(frozen=True)
class FetchProfile:
    """Start-up timings of one CPU layer's batch-1 decode step (``top_k`` routes, none of
    their experts on the GPU) for each candidate count ``n`` of them fetched: the GPU's gather
    and expert kernels for the first ``n`` routes (``gpu_us``) and, at the same time, the CPU
    workers on the other routes (``cpu_us``); medians over the trials, microseconds."""

    cpu_us: dict[int, float]
    gpu_us: dict[int, float]

    def step_us(self) -> dict[int, float]:
        """Per count: the later of the two sides (the layer's step waits for both)."""
        return {n: max(self.cpu_us[n], self.gpu_us[n]) for n in sorted(self.cpu_us)}

    @property
    def routes(self) -> int:
        """The count chosen (:func:`choose_fetch_routes`)."""
        return choose_fetch_routes(self.step_us())

    def as_dict(self) -> dict[str, Any]:
        def us(d: dict[int, float]) -> dict[str, float]:
            return {str(n): round(t, 1) for n, t in sorted(d.items())}

        return {"routes": self.routes, "step_us": us(self.step_us()), "cpu_us": us(self.cpu_us),
                "gpu_us": us(self.gpu_us)}


def choose_fetch_routes(step_us: dict[int, float], gain: float = FETCH_GAIN) -> int:
    """The fewest fetched routes whose step is within ``gain`` of the shortest measured."""
    best = min(step_us.values())
    return min(n for n, t in step_us.items() if t <= best * (1.0 + gain))


def measure_fetch_routes(
    experts: Any, bank: Any, cpu: Any, registration: Any, staging: FetchStaging, top_k: int, act_dtype: torch.dtype,
    activation: str, max_routes: int, native: Any = None, trials: int = FETCH_TRIALS, seed: int = 0,
) -> FetchProfile:  # fmt: skip
    """Time a batch-1 step of one CPU layer (``experts``, its CPU ``bank``) with 0 ..
    ``max_routes`` (at most ``top_k``) of its routes fetched from the page-locked banks while
    ``cpu`` (:class:`~freetoken.backends.contract.CpuExperts`, synchronous kernels) computes
    the rest, and choose the count. On a GPU the fetch (captured in a graph, as decode steps
    run it) is launched first and the CPU kernels run while it does, so the two compete for
    the host's memory as in a step; on a host device the two sides run one after the other."""
    gen = torch.Generator().manual_seed(seed)
    counts = list(range(min(int(max_routes), int(top_k), staging.slots) + 1))
    sides = {n: _FetchSide(experts, registration, staging, activation, top_k, n, act_dtype, native) for n in counts[1:]}
    cpu_s: dict[int, list[float]] = {n: [] for n in counts}
    gpu_s: dict[int, list[float]] = {n: [] for n in counts}
    for trial in range(trials + 1):  # the first round warms both sides up, untimed
        for n in counts:
            ids = torch.randperm(int(experts.num_experts), generator=gen)[:top_k].to(torch.int32).view(1, top_k)
            x = torch.randn(1, int(experts.hidden), generator=gen).to(act_dtype)
            w = torch.rand(1, top_k, generator=gen)
            cpu_ids = ids.clone()
            cpu_ids[0, :n] = -1
            side = sides.get(n)
            if side is not None:
                side.launch(x, ids, w)
            t0 = time.perf_counter()
            cpu.run(bank, x, cpu_ids, w)
            t_cpu = time.perf_counter() - t0
            t_gpu = side.finish() if side is not None else 0.0
            if trial:
                cpu_s[n].append(t_cpu)
                gpu_s[n].append(t_gpu)
    return FetchProfile({n: statistics.median(v) * 1e6 for n, v in cpu_s.items()},
                        {n: statistics.median(v) * 1e6 for n, v in gpu_s.items()})


class _FetchSide:
    """The GPU side of :func:`measure_fetch_routes` for ``n`` fetched routes: a
    :class:`StagedFetch` over the shared slots taking the first ``n`` routes of a 1-token
    step, replayed from a CUDA graph on a GPU (eager where capture fails, and on a host
    device, where :meth:`launch` computes it and times it there and then)."""

    def __init__(self, experts: Any, registration: Any, staging: FetchStaging, activation: str, top_k: int,
                 n: int, act_dtype: torch.dtype, native: Any) -> None:  # fmt: skip
        self.device = staging.device
        self.fetch = StagedFetch(experts, registration, staging, activation, top_k, n / top_k, n, native=native)
        self.x = torch.zeros(1, int(experts.hidden), dtype=act_dtype, device=self.device)
        self.ids = torch.zeros(1, top_k, dtype=torch.int32, device=self.device)
        self.w = torch.zeros(1, top_k, dtype=torch.float32, device=self.device)
        self.graph: Any = None
        self.events: Any = None
        self._host_s = 0.0

    def _capture(self) -> None:
        if not on_gpu(self.device) or self.events is not None:
            return
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self.fetch.forward_routes(self.x, self.ids, self.w)  # kernels compiled, constants made
        torch.cuda.synchronize(self.device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.fetch.forward_routes(self.x, self.ids, self.w)
            self.graph = graph
        except RuntimeError as exc:  # timed eagerly: the launches count in, the fetch looks slower
            log.debug("locked fetch timing: graph capture failed (%s); timing eager launches", exc)
            torch.cuda.synchronize(self.device)

    def launch(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        self._capture()
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(w)
        if self.events is None:  # host device: compute now
            t0 = time.perf_counter()
            self.fetch.forward_routes(self.x, self.ids, self.w)
            self._host_s = time.perf_counter() - t0
            return
        torch.cuda.synchronize(self.device)
        start, end = self.events
        start.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fetch.forward_routes(self.x, self.ids, self.w)
        end.record()

    def finish(self) -> float:
        """Seconds the GPU side took."""
        if self.events is None:
            return self._host_s
        end = self.events[1]
        end.synchronize()
        return self.events[0].elapsed_time(end) / 1e3


def locked_fetch_supported(experts: Any) -> bool:
    return {int(t.fmt) for t in (experts.gate, experts.up, experts.down)} <= PACKED_FORMATS


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
        """(cpu mask, locked mask), bool ``[T, K]``, computed on the device: one kernel
        where Triton runs (:func:`~freetoken.moe.experts.route_split.locked_split`), else
        the torch ops (:func:`locked_split_torch`)."""
        if on_gpu(ids.device) and triton_target.for_device(ids.device).usable:
            from freetoken.moe.experts.route_split import locked_split

            masks = locked_split(ids, self.resident, self.fraction, self.max_fetch)
            if masks is not None:
                return masks
        return locked_split_torch(ids, self.resident, self.fraction, self.max_fetch)


def locked_split_torch(ids: torch.Tensor, resident: torch.Tensor, fraction: float,
                       max_fetch: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:meth:`LockedPlacement.split` as torch ops on ids' device (no host sync)."""
    valid = ids >= 0
    miss = valid & ~resident[ids.clamp(min=0).long()]
    flat = miss.reshape(-1)
    rank = torch.cumsum(flat.to(torch.int32), 0) - 1
    budget = torch.clamp(torch.floor(flat.sum().to(torch.float32) * fraction + 0.5), max=max_fetch)
    locked = flat & (rank < budget)
    return (flat & ~locked).reshape(ids.shape), locked.reshape(ids.shape)


def fetch_budget(missed: int, fraction: float, max_fetch: int) -> int:
    """Locked routes of a step with ``missed`` missed routes: ``round(fraction * missed)``
    (float32, halves up, as :meth:`LockedPlacement.split` computes it on the device), at most
    ``max_fetch``."""
    return int(min(np.floor(np.float32(missed) * np.float32(fraction) + np.float32(0.5)), max_fetch))


def locked_routes(miss: np.ndarray, fraction: float, max_fetch: int) -> np.ndarray:
    """Host form of :meth:`LockedPlacement.split`'s locked mask, for one layer's ``miss [T, K]``."""
    flat = miss.reshape(-1)
    rank = np.cumsum(flat) - 1
    return (flat & (rank < fetch_budget(int(flat.sum()), fraction, max_fetch))).reshape(miss.shape)


def mapped_sources(experts: Any, registration: Any, device: Any) -> list[Any]:
    """One layer's gate, up and down stacks where kernels read them in the registered host
    banks: their mapped device addresses as uint8 pointers, or, where the device is the host
    (a simulated GPU), the bank tensors themselves. Raises KeyError or RuntimeError for a
    stack outside the mapped ranges."""
    raws = (experts.gate, experts.up, experts.down)
    if torch.device(device).type == "cpu":
        return [t.raw_torch().reshape(-1).view(torch.uint8) for t in raws]
    return [DevicePointer(registration.device_address(t.raw_torch()), torch.uint8) for t in raws]


class SplitGpuExperts(GpuRoutedExperts):
    """A CPU layer's GPU side with locked fetch beside an expert cache: routes to cached
    experts through the cache (``cached``, or none), the other GPU routes through
    ``fetched`` (the layer's :class:`StagedFetch`)."""

    def __init__(self, cached: Optional[Any], resident: Any, fetched: Any, hidden: int) -> None:
        self.cached, self.resident, self.fetched, self.hidden = cached, resident, fetched, hidden

    def forward(self, x: torch.Tensor, gpu_ids: torch.Tensor, w: torch.Tensor, out: Any = None) -> torch.Tensor:
        from freetoken.moe.experts.gpu_experts import finish_output, float32_output

        if self.cached is None:
            return self.fetched.forward(x, gpu_ids, w, out)
        valid = gpu_ids >= 0
        minus = torch.full_like(gpu_ids, -1)
        hit = valid & self.resident[gpu_ids.clamp(min=0).long()]
        y, direct = float32_output(out, x, x.shape[0], self.hidden, x.device)
        self.cached.forward(x, torch.where(hit, gpu_ids, minus), w, out=y)
        y.add_(self.fetched.forward(x, torch.where(valid & ~hit, gpu_ids, minus), w, out=torch.empty_like(y)))
        return finish_output(y, out, direct, x.dtype)

    def warmup(self, batch_sizes: Any, top_k: int, x_dtype: Any = None) -> None:
        if self.cached is not None:
            self.cached.warmup(batch_sizes, top_k, x_dtype)
        self.fetched.warmup(batch_sizes, top_k, x_dtype)


def first_routes(tokens: int, top_k: int, fraction: float, max_fetch: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(locked routes ``n``, CPU mask bool ``[T, K]``, slot ids int32 ``[T, K]``) of a step
    whose routes all missed: the first ``n`` routes in (token, k) order go to slots 0..n-1,
    the others (slot -1) to the CPU. Host tensors."""
    n = fetch_budget(tokens * top_k, fraction, max_fetch)
    flat = torch.arange(tokens * top_k, dtype=torch.int32)
    slots = torch.where(flat < n, flat, torch.full_like(flat, -1)).reshape(tokens, top_k)
    return n, slots < 0, slots


class FetchStaging:
    """Device slots for the experts a step fetches, one buffer per stack role (gate, up,
    down), each sized for ``slots`` experts of the largest such stack among the layers."""

    def __init__(self, layers: dict[int, Any], slots: int, device: Any) -> None:
        self.slots = int(slots)
        self.device = torch.device(device)
        per = [max(int(getattr(e, role).nbytes) // int(e.num_experts) for e in layers.values())
               for role in ("gate", "up", "down")]  # fmt: skip
        self.buffers = tuple(torch.empty(self.slots * b, dtype=torch.uint8, device=self.device) for b in per)

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers)

    @staticmethod
    def bytes_for(expert_bytes: int, slots: int) -> int:
        """Device bytes of the slots for experts of ``expert_bytes`` (gate + up + down)."""
        return int(expert_bytes) * int(slots)


class StagedFetch(GpuRoutedExperts):
    """A CPU layer's locked routes computed on the GPU from staging slots: their experts
    copied from the mapped host banks by :func:`~freetoken.moe.experts.expert_gather.gather_routes`,
    then the packed kernels over the slots.

    :meth:`forward_routes` takes a whole step's routing and computes its first
    ``fetch_budget`` routes (no expert cache: every route missed); :meth:`forward` takes ids
    that are -1 but for the locked routes (beside a cache, in :class:`SplitGpuExperts`)."""

    #: the executor hands :meth:`forward_routes` the whole routing (the split is by position)
    takes_whole_routing: ClassVar[bool] = True
    splits_routes: ClassVar[bool] = True

    def __init__(self, experts: Any, registration: Any, staging: FetchStaging, activation: str, top_k: int,
                 fraction: float, max_fetch: int, native: Any = None) -> None:  # fmt: skip
        from freetoken.kernels import moe_packed as tp
        from freetoken.moe.experts.gpu_packed_experts import PackedGpuExperts

        self.device = staging.device
        self.top_k = int(top_k)
        self.fraction = float(fraction)
        self.max_fetch = min(int(max_fetch), staging.slots)
        self.hidden = int(experts.hidden)
        raws = (experts.gate, experts.up, experts.down)
        self.expert_bytes = [int(t.nbytes) // int(experts.num_experts) for t in raws]
        self.sources = mapped_sources(experts, registration, self.device)
        # per-route kernels for any batch: a step computes at most max_fetch routes
        config = dataclasses.replace(tp.default_config(self.device), max_routes=1 << 30)
        slots = tuple(buf[: self.max_fetch * per] for buf, per in zip(staging.buffers, self.expert_bytes))
        self.packed = PackedGpuExperts.over_slots(experts, slots, self.max_fetch, self.device,
                                                  activation=activation, config=config, native=native)
        self._per_tokens: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    # ---- the constants of a batch size ---------------------------------------------------
    def for_tokens(self, tokens: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(locked routes, CPU mask bool ``[T, K]``, slot ids int32 ``[T, K]``) of a step of
        ``tokens`` with no expert cache: the first routes in (token, k) order are locked."""
        got = self._per_tokens.get(tokens)
        if got is None:
            if on_gpu(self.device) and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"locked fetch: no constants for batch size {tokens} during graph capture "
                                   "(warmup() with every captured batch size first)")
            n, cpu, slots = first_routes(tokens, self.top_k, self.fraction, self.max_fetch)
            got = (n, cpu.to(self.device), slots.to(self.device))
            self._per_tokens[tokens] = got
        return got

    # ---- a step ----------------------------------------------------------------------------
    def _gather(self, experts: torch.Tensor, count: int) -> None:
        from freetoken.moe.experts.expert_gather import gather_routes

        p = self.packed
        gather_routes(self.sources, [s.data.view(-1) for s in (p.gate, p.up, p.down)], experts, count,
                      self.expert_bytes)  # fmt: skip

    def forward_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The step's first ``fetch_budget`` routes (every route missed), ``[T, H]`` in x's dtype."""
        n, _, slot_ids = self.for_tokens(int(x.shape[0]))
        if n:
            self._gather(ids.reshape(-1), n)  # route j's expert into slot j
        return self.packed.forward(x, slot_ids, w)

    def forward(self, x: torch.Tensor, gpu_ids: torch.Tensor, w: torch.Tensor, out: Any = None) -> torch.Tensor:
        """``gpu_ids`` -1 but for the locked routes (at most ``max_fetch``), each copied into
        the slot of its rank in (token, k) order."""
        locked = gpu_ids >= 0
        flat = locked.reshape(-1)
        rank = torch.cumsum(flat.to(torch.int32), 0) - 1
        minus = torch.full_like(rank, -1)
        slot_ids = torch.where(flat, rank, minus).reshape(gpu_ids.shape)
        experts = torch.full((self.max_fetch + 1,), -1, dtype=torch.int32, device=gpu_ids.device)
        experts.scatter_(0, torch.where(flat, rank, torch.full_like(rank, self.max_fetch)).long(),
                         gpu_ids.reshape(-1).to(torch.int32))  # fmt: skip
        self._gather(experts, self.max_fetch)
        return self.packed.forward(x, slot_ids, w, out)

    def warmup(self, batch_sizes: Any, top_k: int, x_dtype: Any = None) -> None:
        """Compile the kernels and make the batch sizes' constants before a graph capture."""
        for tokens in batch_sizes:
            n, _, slot_ids = self.for_tokens(int(tokens))
            x = torch.randn(tokens, self.hidden, device=self.device).to(x_dtype or torch.bfloat16)
            w = torch.rand(tokens, top_k, device=self.device)
            ids = torch.randint(-1, self.max_fetch, (tokens, top_k), device=self.device, dtype=torch.int32)
            for slots in (slot_ids, ids):
                self.packed.forward(x, slots, w)
                # beside a cache the slots' sums go into SplitGpuExperts' float32 output
                self.packed.forward(x, slots, w, out=torch.empty(tokens, self.hidden, device=self.device))
            self._gather(ids.clamp(min=0).reshape(-1), min(max(n, 1), tokens * top_k))


@dataclasses.dataclass
class FirstRoutesPlacement(Placement):
    """CPU routes = all but the first ``fetch_budget`` routes of the step (no expert cache:
    every route missed); the masks are :class:`StagedFetch`'s constants of the batch size."""

    fetch: Any = None  # the layer's StagedFetch
    explicit_mask: ClassVar[bool] = True

    def cpu_mask(self, ids: Any) -> Any:
        return self.fetch.for_tokens(int(ids.shape[0]))[1]
