"""Long prompts through the GPU: the CPU layers' experts streamed over PCIe.

A prefill chunk of many tokens touches most experts of a layer, many times: the CPU
workers need ``T * K`` expert passes, while the GPU needs the routed experts' bytes once
(PCIe) and computes the chunk as grouped GEMMs in a fraction of that time.
:class:`PrefillStreamer` keeps device buffers of one layer's experts each (one with
``routed``, two with ``all``), the experts at their offsets in the checkpoint's stacks, and
copies on the :class:`CopyQueue`'s side
stream, ordered after the compute that last read the buffer. Two ways to fill them
(``experts``):

* ``routed`` (default): once the layer's router has run, only the experts the chunk
  routes to are copied (of a layer with experts in the expert cache, only those the cache
  does not hold: its routes to cached experts run on the cache's slots). Experts no token
  routes to cost nothing, which matters for chunks of a few hundred tokens and for models
  whose routing is uneven. Where the host banks are
  page-locked and mapped and Triton runs, one gather kernel per stack
  (:mod:`freetoken.moe.expert_gather`) copies them, the routed set read on the device: the
  host queues every layer of the prompt without waiting for the GPU. Otherwise the routed
  set is read back and the copy engine copies the runs of consecutive routed experts, in
  :data:`ROUTED_PARTS` parts: the compute of part ``p`` (its routes only) overlaps the copy
  of part ``p + 1``.
* ``all``: every expert of the layer, layer ``l + 1``'s copy issued while layer ``l``
  computes, so the copies run back to back and the compute hides behind them.

The buffers hold the checkpoint's bytes: GGUF block formats the packed kernels read
(computed by :class:`~freetoken.moe.gpu_packed_experts.PackedGpuExperts`' large-batch
path, the grouped kernels over the blocks as they are), or float
experts in the activation dtype (:class:`~freetoken.moe.gpu_experts.GpuExperts`).

Whether a chunk streams: ``mode`` ``on`` streams every prefill chunk, ``auto`` those of at
least ``min_tokens`` tokens, measured at start by :func:`measure_threshold` (the time to
copy one layer against the CPU workers' time per token) unless given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from freetoken.moe.copy_queue import CopyQueue, CopyTicket
from freetoken.moe.gpu_packed_experts import PACKED_FORMATS, DequantScratch

log = logging.getLogger(__name__)

#: parts a routed layer's copy is split into, each computed once it has arrived
ROUTED_PARTS = 4

_FLOAT_FMTS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml F32, F16, BF16


def streamable(experts: Any, act_dtype: torch.dtype, packed_ok: bool) -> bool:
    """Whether one layer's experts can be computed on the GPU from their bytes as they are."""
    fmts = {int(t.fmt) for t in (experts.gate, experts.up, experts.down)}
    if packed_ok and fmts <= PACKED_FORMATS:
        return True
    return len(fmts) == 1 and _FLOAT_FMTS.get(fmts.pop()) == act_dtype


def buffer_count(experts: str) -> int:
    """Layer-sized device buffers the streamer keeps with ``--moe-stream-experts experts``
    (``mapped`` reads the page-locked host banks in place: none)."""
    return {"routed": 1, "all": 2, "mapped": 0}[experts]


@dataclasses.dataclass
class StreamProfile:
    pcie_gb_s: float  # host -> device copy of one layer's bytes
    layer_bytes: int
    cpu_us_per_token: Optional[float]  # CPU experts of one layer, per prompt token
    min_tokens: int
    source: str  # "measured", "given"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PrefillStreamer:
    def __init__(
        self, layers: dict[int, Any], device: Any, act_dtype: torch.dtype, activation: str, packed_ok: bool,
        scratch: DequantScratch, copies: CopyQueue, mode: str = "auto", min_tokens: Optional[int] = None,
        experts: str = "routed", registration: Any = None,
    ) -> None:  # fmt: skip
        if experts not in ("routed", "all", "mapped"):
            raise ValueError(f"streamed experts {experts!r}: expected 'routed', 'all' or 'mapped'")
        if experts == "mapped" and registration is None:
            raise ValueError("streamed experts 'mapped' read the host banks in place: they need the banks "
                             "page-locked and mapped (a HostRegistration)")
        self.layers = dict(sorted(layers.items()))
        self.order = list(self.layers)
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.activation = activation
        self.packed_ok = packed_ok
        self.scratch = scratch
        self.copies = copies
        self.mode = mode
        self.min_tokens = min_tokens
        self.routed = experts == "routed"
        self.mapped: dict[int, Any] = {}
        if experts == "mapped":
            from freetoken.moe.locked_fetch import mapped_experts

            # the grouped kernels read the routed experts' blocks over PCIe where the banks
            # are: no copy, no read-back of the routed set, one launch pair per layer
            self.mapped = {layer: mapped_experts(e, registration, self.device, activation, prompts=True)
                           for layer, e in self.layers.items()}
        # routed copies by the gather kernel: each layer's stacks at their mapped host addresses
        self.gather_src: dict[int, list[Any]] = {}
        if self.routed and packed_ok and self.device.type == "cuda" and registration is not None \
                and registration.mapped:  # fmt: skip
            self.gather_src = {layer: _mapped_sources(e, registration, self.device)
                               for layer, e in self.layers.items()}
            self.gather_src = {k: v for k, v in self.gather_src.items() if v}
        self._gathered: Any = None  # bytes the gather kernels copied (a device counter)
        self._views: dict[int, Any] = {}  # layer -> its compute view over the one buffer (routed)
        #: layer -> (its cached experts, their residency [E] on the device) or None: set by
        #: the owner of an expert cache over these layers (routed streaming copies the rest)
        self.cached: Optional[Callable[[int], Optional[tuple[Any, Any]]]] = None
        self.profile: Optional[StreamProfile] = None
        size = max(e.nbytes for e in self.layers.values())
        # routed: a layer's copy starts after its router, so after the previous layer's
        # experts were computed; one buffer serves every layer. all: two alternate.
        count = buffer_count(experts)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self._released: list[Any] = [None] * count  # compute events after the last reader of each buffer
        self._inflight: dict[int, tuple[int, CopyTicket]] = {}  # layer -> (buffer, its copy)
        self.streamed_layers = 0
        self._copied_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def gathers(self) -> bool:
        """Whether routed copies run as gather kernels over the mapped banks."""
        return bool(self.gather_src)

    @property
    def streamed_bytes(self) -> int:
        """Expert bytes moved to the GPU so far (reads the gather kernels' device counter)."""
        gathered = int(self._gathered.item()) if self._gathered is not None else 0
        return self._copied_bytes + gathered

    def wants(self, tokens: int, decode: bool) -> bool:
        """Whether a step of ``tokens`` tokens streams (never a decode step)."""
        if decode or self.mode == "off":
            return False
        return self.mode == "on" or (self.min_tokens is not None and tokens >= self.min_tokens)

    # ---- buffers ------------------------------------------------------------------------
    def _slot(self, layer: int) -> int:
        return self.position[layer] % len(self.buffers)

    def _parts(self, layer: int, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device view, host bytes) of the layer's gate, up and down stacks inside ``buf``."""
        e = self.layers[layer]
        pairs, off = [], 0
        for t in (e.gate, e.up, e.down):
            src = t.raw_torch().reshape(-1)
            src = src.view(torch.uint8) if src.dtype != torch.uint8 else src
            n = src.numel()
            pairs.append((buf[off:off + n], src))
            off += n
        return pairs

    def start_step(self) -> None:
        """A streaming step begins: with ``all``, the first CPU layer's copy starts now."""
        if not self.routed and not self.mapped:
            self.prefetch(self.order[0])

    def forward(self, layer: int, x: Any, ids: Any, w: Any) -> Any:
        """The layer's routed experts for a streamed chunk (``x.dtype``). With ``routed``
        and an expert cache holding some of the layer's experts (:attr:`cached`), the routes
        to those are computed from the cache's slots and only the others are copied."""
        if self.mapped:
            self.streamed_layers += 1  # (the bytes are read by the kernels: not counted)
            return self.mapped[layer].forward(x, ids, w)
        if self.routed:
            held = self.cached(layer) if self.cached is not None else None
            if held is None:
                return self._forward_routed(layer, x, ids, w)
            experts, resident = held
            rest = torch.where(resident[ids.clamp(min=0).long()], torch.full_like(ids, -1), ids)
            y = self._forward_routed(layer, x, rest, w)
            return y.add_(experts.forward_routes(x, ids, w))
        out = self.experts(layer).forward(x, ids, w)
        self.release(layer)
        return out

    def _forward_routed(self, layer: int, x: Any, ids: Any, w: Any) -> Any:
        e = self.layers[layer]
        E = e.num_experts
        flat = ids.reshape(-1).long()
        counts = torch.zeros(E, dtype=torch.int32, device=ids.device)
        counts.index_add_(0, flat.clamp(min=0), (flat >= 0).to(torch.int32))
        if layer in self.gather_src:
            return self._forward_gathered(layer, x, ids, w, counts)
        used = np.flatnonzero(counts.cpu().numpy())  # waits for this layer's router
        b = self._slot(layer)
        buf = self.buffers[b]
        y = torch.zeros(x.shape[0], e.hidden, dtype=torch.float32, device=self.device)
        if used.size == 0:
            return y.to(x.dtype)
        parts = np.array_split(used, min(ROUTED_PARTS, used.size))
        part_of = np.full(E, -1, dtype=np.int32)
        tickets = []
        after = self._released[b]
        for p, experts in enumerate(parts):
            part_of[experts] = p
            # issued here, not by the copy thread: the compute waits for them next
            tickets.append(self.copies.submit_now(self._ranges(layer, buf, experts), after=after))
            after = None
        part_of_dev = torch.from_numpy(part_of).to(self.device)
        view = self._compute_view(layer, buf)
        part_ids = part_of_dev[ids.clamp(min=0).long()]
        minus = torch.full_like(ids, -1)
        scratch = torch.empty_like(y) if len(parts) > 1 else None
        for p, ticket in enumerate(tickets):
            ticket.order_before()
            ids_p = torch.where((part_ids == p) & (ids >= 0), ids, minus)
            view.forward(x, ids_p, w, out=scratch if p else y)
            if p:
                y.add_(scratch)
            self._copied_bytes += ticket.nbytes
        self.streamed_layers += 1
        self._released[b] = self.copies.compute_event()
        return y.to(x.dtype)

    def _forward_gathered(self, layer: int, x: Any, ids: Any, w: Any, counts: Any) -> Any:
        """The routed experts copied by gather kernels on the current stream (after the
        router, before the compute that reads them; the previous layer's compute, the last
        reader of the buffer, is earlier on the same stream), then computed: nothing here
        waits for the GPU."""
        from freetoken.moe.expert_gather import gather_experts

        e = self.layers[layer]
        buf = self.buffers[0]
        for (dst, _), src in zip(self._parts(layer, buf), self.gather_src[layer]):
            gather_experts(src, dst, counts, e.num_experts)
        if self._gathered is None:
            self._gathered = torch.zeros((), dtype=torch.int64, device=self.device)
        self._gathered.add_((counts > 0).sum() * (e.nbytes // e.num_experts))
        self.streamed_layers += 1
        view = self._views.get(layer)
        if view is None:
            view = self._views[layer] = self._compute_view(layer, buf)
        return view.forward(x, ids, w)

    def _ranges(self, layer: int, buf: torch.Tensor, experts: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device view, host bytes) pairs copying ``experts`` (sorted ids) of each stack:
        one pair per run of consecutive experts."""
        e = self.layers[layer]
        starts = np.flatnonzero(np.diff(experts, prepend=-2) != 1)
        runs = [(int(experts[a]), int(experts[z - 1]) + 1) for a, z in zip(starts, list(starts[1:]) + [experts.size])]
        pairs = []
        for dst, src in self._parts(layer, buf):
            per = src.numel() // e.num_experts
            pairs += [(dst[a * per:z * per], src[a * per:z * per]) for a, z in runs]
        return pairs

    def prefetch(self, layer: int) -> None:
        """Start copying ``layer``'s experts into its buffer (no-op if already under way)."""
        if layer in self._inflight:
            return
        b = self._slot(layer)
        ticket = self.copies.submit(self._parts(layer, self.buffers[b]), after=self._released[b])
        self._inflight[layer] = (b, ticket)

    def experts(self, layer: int) -> Any:
        """The layer's experts on the device, ready for the current stream's next kernels;
        the next CPU layer's copy starts behind this one."""
        self.prefetch(layer)
        b, ticket = self._inflight[layer]
        ticket.order_before()
        i = self.position[layer]
        if i + 1 < len(self.order):
            self.prefetch(self.order[i + 1])
        self.streamed_layers += 1
        self._copied_bytes += ticket.nbytes
        return self._compute_view(layer, self.buffers[b])

    def release(self, layer: int) -> None:
        """The current stream's kernels after this point no longer read ``layer``'s buffer."""
        b, _ = self._inflight.pop(layer)
        self._released[b] = self.copies.compute_event()

    def _compute_view(self, layer: int, buf: torch.Tensor) -> Any:
        from freetoken.moe.gpu_experts import GpuExperts
        from freetoken.moe.gpu_packed_experts import PackedGpuExperts

        e = self.layers[layer]
        (g, _), (u, _), (d, _) = self._parts(layer, buf)
        if {int(t.fmt) for t in (e.gate, e.up, e.down)} <= PACKED_FORMATS and self.packed_ok:
            return PackedGpuExperts.over_device_bytes(e, (g, u, d), self.device, activation=self.activation,
                                                      scratch=self.scratch)
        dt = _FLOAT_FMTS[int(e.gate.fmt)]
        views = [x.view(dt).view(*t.shape) for x, t in ((g, e.gate), (u, e.up), (d, e.down))]
        return GpuExperts(*views, activation=self.activation)

    def close(self) -> None:
        for _, ticket in self._inflight.values():
            try:
                ticket.order_before()
            except RuntimeError:
                pass
        self._inflight.clear()


def _mapped_sources(experts: Any, registration: Any, device: Any) -> list[Any]:
    """:func:`~freetoken.moe.locked_fetch.mapped_sources`, empty when a stack lies outside
    the registered ranges."""
    from freetoken.moe.locked_fetch import mapped_sources

    try:
        return mapped_sources(experts, registration, device)
    except (KeyError, RuntimeError):
        return []


def measure_threshold(streamer: PrefillStreamer, cpu: Any, bank: Any, top_k: int, given: Optional[int],
                      tokens: int = 64) -> StreamProfile:  # fmt: skip
    """Time one layer's copy (PCIe) and, unless ``given``, the CPU experts of that layer on
    ``tokens`` random tokens (the synchronous CPU kernels, before the coordinator takes the
    cores); the threshold is the token count where the CPU would take as long as the copy."""
    layer = streamer.order[0]
    e = streamer.layers[layer]
    nbytes = e.nbytes
    if streamer.buffers:
        pairs = streamer._parts(layer, streamer.buffers[0])
    else:  # mapped streaming keeps no buffer: the rate from a 64 MiB copy into a temporary one
        src = e.gate.raw_torch().reshape(-1)
        src = (src.view(torch.uint8) if src.dtype != torch.uint8 else src)[: 64 << 20]
        pairs = [(torch.empty(src.numel(), dtype=torch.uint8, device=streamer.device), src)]
    moved = sum(int(src.numel()) for _, src in pairs)
    streamer.copies.submit(pairs).order_before()  # first touch: page faults, registration
    _sync(streamer.device)
    t0 = time.perf_counter()
    streamer.copies.submit(pairs).order_before()
    _sync(streamer.device)
    pcie = moved / (time.perf_counter() - t0) / 1e9
    copy_s = nbytes / (pcie * 1e9)  # one layer's bytes at that rate
    per_token = None
    if given is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, e.hidden, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e.num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
        w = torch.rand(tokens, top_k, generator=gen)
        cpu.run(bank, x, ids, w)  # warm
        t0 = time.perf_counter()
        cpu.run(bank, x, ids, w)
        per_token = (time.perf_counter() - t0) / tokens
        # the GPU's own compute of a streamed layer hides behind the next copy; 10% margin
        min_tokens = max(2, math.ceil(1.1 * copy_s / per_token))
    else:
        min_tokens = given
    profile = StreamProfile(round(pcie, 2), nbytes, None if per_token is None else round(per_token * 1e6, 2),
                            min_tokens, "given" if given is not None else "measured")
    streamer.min_tokens = min_tokens
    streamer.profile = profile
    return profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
