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
  whose routing is uneven. The one buffer holds a *window* of ``ceil(E / windows)``
  experts, not a whole layer: the layer is copied and computed window by window (experts
  ``0 .. W-1``, then ``W .. 2W-1``, ...), each window's routes only, their outputs summed.
  Every byte is still copied once and the windows' compute is small beside their copies,
  so a prompt costs about the same while the buffer takes a fraction of a layer's device
  memory (4 windows: a quarter), room the memory plan gives to resident expert layers.
  Where the host banks are page-locked and mapped and Triton runs, one gather kernel per
  stack and window (:mod:`freetoken.moe.experts.expert_gather`) copies them, the routed set read
  on the device: the host queues every layer of the prompt without waiting for the GPU.
  Otherwise the routed set is read back and the copy engine copies the runs of
  consecutive routed experts of each window, the window computed once they arrived.
* ``all``: every expert of the layer, layer ``l + 1``'s copy issued while layer ``l``
  computes, so the copies run back to back and the compute hides behind them.

The buffers hold the checkpoint's bytes: GGUF block formats the packed kernels read
(computed by :class:`~freetoken.moe.experts.gpu_packed_experts.PackedGpuExperts`' large-batch
path, the grouped kernels over the blocks as they are), or float
experts in the activation dtype (:class:`~freetoken.moe.experts.gpu_experts.GpuExperts`).

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

from freetoken.backends.contract import on_gpu
from freetoken.moe.experts.copy_queue import CopyQueue, CopyTicket
from freetoken.moe.experts.gpu_packed_experts import PACKED_FORMATS, DequantScratch

log = logging.getLogger(__name__)

#: windows a routed layer is streamed in by default (``--moe-stream-windows``): the buffer
#: holds a quarter of a layer's experts
STREAM_WINDOWS = 4

_FLOAT_FMTS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml F32, F16, BF16


def streamable(experts: Any, act_dtype: torch.dtype, packed_ok: bool) -> bool:
    """Whether one layer's experts can be computed on the GPU from their bytes as they are."""
    fmts = {int(t.fmt) for t in (experts.gate, experts.up, experts.down)}
    if packed_ok and fmts <= PACKED_FORMATS:
        return True
    return len(fmts) == 1 and _FLOAT_FMTS.get(fmts.pop()) == act_dtype


def buffer_count(experts: str) -> int:
    """Device buffers the streamer keeps with ``--moe-stream-experts experts`` (``routed``:
    one of a window of experts; ``all``: two of a layer each)."""
    return {"routed": 1, "all": 2}[experts]


def window_experts(num_experts: int, windows: int) -> int:
    """Experts of one window when a layer of ``num_experts`` is streamed in ``windows``."""
    if windows < 1:
        raise ValueError(f"stream windows must be >= 1, got {windows}")
    return -(-int(num_experts) // min(int(windows), max(int(num_experts), 1)))


def buffer_bytes(experts: str, layer_bytes: list[int], num_experts: int, windows: int = STREAM_WINDOWS) -> int:
    """Device bytes of the streamer's buffers for layers of ``layer_bytes`` (each
    ``num_experts`` experts of equal size): ``routed`` one window of the largest layer's
    experts, ``all`` two of its layers."""
    if not layer_bytes:
        return 0
    largest = max(int(b) for b in layer_bytes)
    if experts == "all":
        return 2 * largest
    return window_experts(num_experts, windows) * (largest // max(int(num_experts), 1))


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
        experts: str = "routed", registration: Any = None, windows: int = STREAM_WINDOWS,
    ) -> None:  # fmt: skip
        if experts not in ("routed", "all"):
            raise ValueError(f"streamed experts {experts!r}: expected 'routed' or 'all'")
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
        # routed copies by the gather kernel: each layer's stacks at their mapped host addresses
        # (a simulated GPU whose device memory is the host's: the bank tensors themselves)
        self.gather_src: dict[int, list[Any]] = {}
        if self.routed and packed_ok and self.device.type in ("cuda", "cpu") and registration is not None \
                and registration.mapped:  # fmt: skip
            self.gather_src = {layer: _mapped_sources(e, registration, self.device)
                               for layer, e in self.layers.items()}
            self.gather_src = {k: v for k, v in self.gather_src.items() if v}
        self._gathered: Any = None  # bytes the gather kernels copied (a device counter)
        self._views: dict[tuple[int, int], Any] = {}  # (layer, first expert) -> a window's view (routed)
        #: layer -> (its cached experts, their residency [E] on the device) or None: set by
        #: the owner of an expert cache over these layers (routed streaming copies the rest)
        self.cached: Optional[Callable[[int], Optional[tuple[Any, Any]]]] = None
        self.profile: Optional[StreamProfile] = None
        num_experts = max((e.num_experts for e in self.layers.values()), default=1)
        #: experts per window of a routed layer (all of them with ``all``)
        self.window = window_experts(num_experts, windows) if self.routed else num_experts
        # routed: a layer's copy starts after its router, so after the previous layer's
        # experts were computed; one buffer of a window serves every layer. all: two
        # layer-sized buffers alternate.
        count = buffer_count(experts)
        size = buffer_bytes(experts, [e.nbytes for e in self.layers.values()], num_experts, windows) // max(count, 1)
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

    def reset_counters(self) -> None:
        """Count from zero again (after the engine's warm-up prefills)."""
        self.streamed_layers = 0
        self._copied_bytes = 0
        if self._gathered is not None:
            self._gathered.zero_()

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

    def _parts(self, layer: int, buf: torch.Tensor, first: int = 0, count: Optional[int] = None,
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """(device view, host bytes) of experts ``first .. first + count`` (default: all) of
        the layer's gate, up and down stacks, one stack after the other inside ``buf``."""
        e = self.layers[layer]
        count = e.num_experts - first if count is None else count
        pairs, off = [], 0
        for t in (e.gate, e.up, e.down):
            src = t.raw_torch().reshape(-1)
            src = src.view(torch.uint8) if src.dtype != torch.uint8 else src
            per = src.numel() // e.num_experts
            src = src[first * per:(first + count) * per]
            n = src.numel()
            pairs.append((buf[off:off + n], src))
            off += n
        return pairs

    def _windows(self, layer: int) -> list[tuple[int, int]]:
        """(first expert, experts) of each window of the layer."""
        E = self.layers[layer].num_experts
        return [(a, min(self.window, E - a)) for a in range(0, E, self.window)]

    def start_step(self) -> None:
        """A streaming step begins: with ``all``, the first CPU layer's copy starts now."""
        if not self.routed:
            self.prefetch(self.order[0])

    def forward(self, layer: int, x: Any, ids: Any, w: Any) -> Any:
        """The layer's routed experts for a streamed chunk (``x.dtype``). With ``routed``
        and an expert cache holding some of the layer's experts (:attr:`cached`), the routes
        to those are computed from the cache's slots and only the others are copied."""
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
        buf = self.buffers[0]
        y = torch.zeros(x.shape[0], e.hidden, dtype=torch.float32, device=self.device)
        part, done = torch.empty_like(y), 0
        for first, n in self._windows(layer):
            mine = used[(used >= first) & (used < first + n)] - first
            if mine.size == 0:
                continue
            # issued here, not by the copy thread: the compute waits for it next; the copy
            # waits for the compute that last read the buffer (the previous window's)
            ticket = self.copies.submit_now(self._ranges(layer, buf, first, n, mine), after=self._released[0])
            ticket.order_before()
            self._window_view(layer, first, n).forward(x, _local_ids(ids, first, n), w, out=part if done else y)
            if done:
                y.add_(part)
            done += 1
            self._released[0] = self.copies.compute_event()
            self._copied_bytes += ticket.nbytes
        self.streamed_layers += 1
        return y.to(x.dtype)

    def _forward_gathered(self, layer: int, x: Any, ids: Any, w: Any, counts: Any) -> Any:
        """The routed experts copied window by window by gather kernels on the current
        stream (after the router, before the compute that reads them; the previous
        window's compute, the last reader of the buffer, is earlier on the same stream),
        each window computed once copied: nothing here waits for the GPU."""
        from freetoken.moe.experts.expert_gather import gather_experts

        e = self.layers[layer]
        buf = self.buffers[0]
        windows = self._windows(layer)
        y = torch.zeros(x.shape[0], e.hidden, dtype=torch.float32, device=self.device) if len(windows) > 1 else None
        part = torch.empty_like(y) if y is not None else None
        out = None
        for k, (first, n) in enumerate(windows):
            for (dst, src_bytes), src in zip(self._parts(layer, buf, first, n), self.gather_src[layer]):
                per = src_bytes.numel() // n
                gather_experts(_offset(src, first * per), dst, counts[first:first + n], n)
            view = self._window_view(layer, first, n)
            if y is None:
                out = view.forward(x, ids, w)
            else:
                view.forward(x, _local_ids(ids, first, n), w, out=y if k == 0 else part)
                if k:
                    y.add_(part)
        if self._gathered is None:
            self._gathered = torch.zeros((), dtype=torch.int64, device=self.device)
        self._gathered.add_((counts > 0).sum() * (e.nbytes // e.num_experts))
        self.streamed_layers += 1
        return out if y is None else y.to(x.dtype)

    def _window_view(self, layer: int, first: int, n: int) -> Any:
        """The compute view of experts ``first .. first + n`` of ``layer`` in the buffer
        (made once per layer and window)."""
        view = self._views.get((layer, first))
        if view is None:
            view = self._views[(layer, first)] = self._compute_view(layer, self.buffers[0], first, n)
        return view

    def _ranges(self, layer: int, buf: torch.Tensor, first: int, n: int, experts: np.ndarray,
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """(device view, host bytes) pairs copying ``experts`` (sorted ids within the window
        of experts ``first .. first + n``) of each stack: one pair per run of consecutive
        experts."""
        starts = np.flatnonzero(np.diff(experts, prepend=-2) != 1)
        runs = [(int(experts[a]), int(experts[z - 1]) + 1) for a, z in zip(starts, list(starts[1:]) + [experts.size])]
        pairs = []
        for dst, src in self._parts(layer, buf, first, n):
            per = src.numel() // n
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

    def _compute_view(self, layer: int, buf: torch.Tensor, first: int = 0, n: Optional[int] = None) -> Any:
        """Experts ``first .. first + n`` (default: all) of ``layer`` as they lie in ``buf``:
        ids ``0 .. n - 1`` of the view are experts ``first ..`` of the layer."""
        from freetoken.moe.experts.gpu_experts import GpuExperts
        from freetoken.moe.experts.gpu_packed_experts import PackedGpuExperts

        e = self.layers[layer]
        n = e.num_experts - first if n is None else n
        (g, _), (u, _), (d, _) = self._parts(layer, buf, first, n)
        if {int(t.fmt) for t in (e.gate, e.up, e.down)} <= PACKED_FORMATS and self.packed_ok:
            return PackedGpuExperts.over_slots(e, (g, u, d), n, self.device, activation=self.activation,
                                               scratch=self.scratch)
        dt = _FLOAT_FMTS[int(e.gate.fmt)]
        views = [x.view(dt).view(n, *t.shape[1:]) for x, t in ((g, e.gate), (u, e.up), (d, e.down))]
        return GpuExperts(*views, activation=self.activation)

    def close(self) -> None:
        for _, ticket in self._inflight.values():
            try:
                ticket.order_before()
            except RuntimeError:
                pass
        self._inflight.clear()


def _local_ids(ids: Any, first: int, n: int) -> Any:
    """``ids`` as ids of the window of experts ``first .. first + n`` (-1 outside it)."""
    return torch.where((ids >= first) & (ids < first + n), ids - first, torch.full_like(ids, -1))


def _offset(src: Any, nbytes: int) -> Any:
    """``src`` (a uint8 tensor or a mapped :class:`~freetoken.moe.experts.locked_fetch.DevicePointer`)
    from its byte ``nbytes`` on."""
    if isinstance(src, torch.Tensor):
        return src[nbytes:]
    from freetoken.moe.experts.locked_fetch import DevicePointer

    return DevicePointer(src.data_ptr() + nbytes, src.dtype)


def _mapped_sources(experts: Any, registration: Any, device: Any) -> list[Any]:
    """:func:`~freetoken.moe.experts.locked_fetch.mapped_sources`, empty when a stack lies outside
    the registered ranges."""
    from freetoken.moe.experts.locked_fetch import mapped_sources

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
    # (a window of the layer with routed streaming; the rate is the same)
    pairs = streamer._parts(layer, streamer.buffers[0], 0, streamer.window)
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
    if on_gpu(device):
        torch.cuda.synchronize(device)
