"""What a GPU session does with the experts that live in host memory, beyond handing
routes to the CPU workers: page-locked banks, the global expert cache, long prompts
streamed through the GPU, the route log and the MoE statistics.

:class:`ExpertTraffic` is built by :class:`~freetoken.moe.session.gpu_session.GpuModelSession`
from the ``--moe-*`` options (:class:`~freetoken.backends.options.MoEOptions`) and the
memory plan, and sits in three places of the session:

* :meth:`start` (before the CPU coordinator takes the cores): registers the banks, fills
  the cache, measures the streaming threshold and (``--moe-locked-fetch auto``) how many
  routes locked fetch takes;
* :meth:`wrap` around each MoE layer's experts function: records the routes (when the
  cache or the statistics need them) and, in a streaming step, computes a CPU layer's
  experts on the GPU from the streamed bytes;
* :meth:`before_step` at each step: reads the previous decode step's routes back (cache
  bookkeeping and fetches, statistics) and decides whether this step streams.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import numpy as np
import torch

from freetoken.backends.contract import BesideFn, OverlappedExpertsFn, on_gpu, plus_beside
from freetoken.backends.options import MoEOptions
from freetoken.moe.experts.copy_queue import CopyQueue
from freetoken.moe.experts.expert_cache import ExpertCache
from freetoken.moe.experts.gpu_packed_experts import DequantScratch
from freetoken.moe.handoff.host_pinning import HostRegistration, register_banks
from freetoken.moe.experts.locked_fetch import (
    FetchProfile,
    FetchStaging,
    FirstRoutesPlacement,
    LockedPlacement,
    SplitGpuExperts,
    StagedFetch,
    locked_fetch_supported,
    locked_routes,
    measure_fetch_routes,
)
from freetoken.moe.placement import Placement
from freetoken.moe.handoff.moe_stats import MoEStats, RouteLog
from freetoken.moe.experts.prefill_stream import PrefillStreamer, StreamProfile, measure_threshold, streamable

log = logging.getLogger(__name__)


class ExpertTraffic:
    def __init__(
        self, options: MoEOptions, device: Any, act_dtype: torch.dtype, moe_layers: list[int], top_k: int,
        max_decode_tokens: int, cache_bytes: int, packed_ok: bool, scratch: DequantScratch,
        stream_planned: bool = True, locked_setting: str = "given", native: Any = None,
    ) -> None:  # fmt: skip
        self.options = options
        #: the backend's routed-expert kernels offered to the packed slots of the cache and of
        #: locked fetch (decode)
        self.native = native
        #: how ``options.locked_fetch`` was chosen: "given", or "auto..." (then it turns itself
        #: off, with a note, where the banks cannot be fetched from)
        self.locked_setting = locked_setting
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.moe_layers = list(moe_layers)
        self.top_k = top_k
        self.max_decode_tokens = max_decode_tokens
        self.cache_bytes = cache_bytes
        self.packed_ok = packed_ok
        self.scratch = scratch
        self.stream_planned = stream_planned  # the memory plan kept room for the streaming buffers
        self.cpu_layers: dict[int, Any] = {}  # layer -> ExpertWeights (host)
        self.activation = "silu"
        self.copies: Optional[CopyQueue] = None
        self.registration: Optional[HostRegistration] = None
        self.cache: Optional[ExpertCache] = None
        self.streamer: Optional[PrefillStreamer] = None
        self.profile: Optional[StreamProfile] = None
        self.route_log: Optional[RouteLog] = None
        self.stats: Optional[MoEStats] = None
        self.notes: list[str] = []
        self.locked = False
        self.locked_routes = 0
        self.fetch_staging: Optional[FetchStaging] = None  # locked fetch by copy
        self.fetch_profile: Optional[FetchProfile] = None  # auto: the start-up measurement
        self._streaming = False
        self._decode = True  # the current step decodes (prompt steps count routes for the cache)
        self._prompt_counts: Optional[torch.Tensor] = None  # [cache rows, E] on the device
        self._prompt_counted = False
        self._last: Optional[tuple[int, bool]] = None  # (tokens, decode) of the previous step
        self._busy_ns: Optional[int] = None

    def add_cpu_layer(self, layer: int, experts: Any, activation: str) -> None:
        self.cpu_layers[layer] = experts
        self.activation = activation

    # ---- start ------------------------------------------------------------------------------
    def start(self, cpu: Any, banks: dict[int, Any], staging: Any) -> None:
        o = self.options
        cpu_layers = self.cpu_layers
        locked = o.locked_fetch > 0 and o.locked_max_fetch > 0 and bool(cpu_layers)
        auto = self.locked_setting.startswith("auto")  # off, with a note, where it cannot apply
        if locked and not (self.packed_ok and all(locked_fetch_supported(e) for e in cpu_layers.values())):
            if not auto:
                from freetoken.backends.triton_target import for_device

                raise ValueError("--moe-locked-fetch: the GPU reads the host banks with its packed kernels, which need "
                                 "GGUF Q4_K/Q5_K/Q6_K/Q8_0/MXFP4 experts, --moe-gpu-experts auto and a GPU where Triton "
                                 f"runs (here: {for_device(self.device).reason}); run without it")
            locked = False
            self.locked_setting = "auto: off (the CPU layers' expert formats are not read by the GPU's kernels)"
        if locked and o.lock_host == "off":
            raise ValueError("--moe-locked-fetch needs page-locked host banks: drop --moe-lock-host off")
        stream = self.stream_planned and o.stream_prefill != "off" and bool(cpu_layers) and all(
            streamable(e, self.act_dtype, self.packed_ok) for e in cpu_layers.values())
        if o.stream_prefill == "on" and cpu_layers and not stream:
            raise ValueError("--moe-stream-prefill on: the CPU layers' expert formats cannot be computed on the GPU "
                             "as stored (GGUF Q4_K/Q5_K/Q6_K/Q8_0/MXFP4, or float experts in the activation dtype)")
        cache = self.cache_bytes > 0 and bool(cpu_layers)
        if stream or cache:
            self.copies = CopyQueue(self.device)
        # mapped for locked fetch's and routed streaming's gather kernels
        self._register(staging, stream or (cache and o.hybrid_max_fetch > 0) or locked,
                       mapped=locked or (stream and o.stream_experts == "routed"))
        why = "; ".join(self.notes) or f"banks are page-locked for CUDA/HIP devices only, not {self.device}"
        if locked and self.registration is None:
            if not auto:
                raise ValueError(f"--moe-locked-fetch needs page-locked host banks, which could not be registered: "
                                 f"{why}")
            locked = False
            self.locked_setting = f"auto: off (the host banks could not be page-locked and mapped: {why})"
            self.notes.append(f"locked fetch {self.locked_setting}")
        self.locked = locked
        if locked and auto:
            self._measure_fetch(cpu, banks)
        if cache:
            self.cache = ExpertCache(cpu_layers, self.cache_bytes, self.device, self.act_dtype, self.activation,
                                     self.packed_ok, self.copies, o.hybrid_max_fetch, self.scratch,  # type: ignore[arg-type]
                                     native=self.native)
            log.info("expert cache: %d slots (%.2f GiB) over %d CPU layers, up to %d fetches per layer and step",
                     self.cache.slots, self.cache.nbytes / 2**30, len(cpu_layers), o.hybrid_max_fetch)
        if stream:
            self.streamer = PrefillStreamer(cpu_layers, self.device, self.act_dtype, self.activation, self.packed_ok,
                                            self.scratch, self.copies, o.stream_prefill,  # type: ignore[arg-type]
                                            o.stream_min_tokens, o.stream_experts, self.registration,
                                            o.stream_windows)
            first = self.streamer.order[0]
            self.profile = measure_threshold(self.streamer, cpu, banks[first], self.top_k, o.stream_min_tokens)
            log.info("long prompts: prefill chunks of %s tokens stream the CPU layers' experts to the GPU "
                     "(one layer %.0f MiB at %.1f GB/s; CPU experts %s us per token)",
                     "any number of" if o.stream_prefill == "on" else f">= {self.profile.min_tokens}",
                     self.profile.layer_bytes / 2**20, self.profile.pcie_gb_s,
                     self.profile.cpu_us_per_token if self.profile.cpu_us_per_token is not None else "-")
        if self.streamer is not None and self.cache is not None and self.streamer.routed:
            self.streamer.cached = self._cached_experts
        if self.cache is not None and o.hybrid_max_fetch > 0:
            self._prompt_counts = torch.zeros((len(self.cache.layers), self.cache.num_experts), dtype=torch.int32,
                                              device=self.device)
        if self.cache is not None or o.collect_stats:
            self.route_log = RouteLog(self.moe_layers, self.max_decode_tokens, self.top_k, self.device)
        if o.collect_stats:
            self.stats = MoEStats(self.moe_layers, o.stats_interval_s)

    def _measure_fetch(self, cpu: Any, banks: dict[int, Any]) -> None:
        """``auto``: time a step of the first CPU layer with 0 .. ``locked_max_fetch`` routes
        fetched beside the CPU's (:func:`measure_fetch_routes`, before the coordinator takes
        the cores) and fetch the fastest count's share of the missed routes; none: off."""
        o = self.options
        first = next(iter(self.cpu_layers))
        self.fetch_staging = FetchStaging(self.cpu_layers, o.locked_max_fetch, self.device)
        profile = measure_fetch_routes(self.cpu_layers[first], banks[first], cpu, self.registration,
                                       self.fetch_staging, self.top_k, self.act_dtype, self.activation,
                                       o.locked_max_fetch, native=self.native)  # fmt: skip
        self.fetch_profile = profile
        routes = profile.routes
        steps = ", ".join(f"{n}: {t:.0f}" for n, t in profile.step_us().items())
        if routes == 0:
            self.locked = False
            self.fetch_staging = None
            self.locked_setting = f"auto: off (measured: a CPU layer's step in us by fetched routes {steps})"
        else:
            self.options = dataclasses.replace(o, locked_fetch=routes / self.top_k)
            self.locked_setting = "auto: measured"
        log.info("locked fetch %s; a CPU layer's batch-1 step in us by fetched routes: %s",
                 "off" if routes == 0 else f"{routes} of {self.top_k} routes", steps)

    def _register(self, staging: Any, wanted: bool, mapped: bool) -> None:
        mode = self.options.lock_host
        if mode == "off" or not self.cpu_layers or not on_gpu(self.device):
            if mode == "on" and not on_gpu(self.device):
                raise ValueError(f"--moe-lock-host on: device {self.device} is not a CUDA/HIP GPU")
            return
        if mode == "auto" and not wanted:
            return
        try:
            self.registration = register_banks(staging, self.cpu_layers.values(), mapped=mapped)
        except RuntimeError as exc:
            if mode == "on":
                raise
            note = f"host expert banks not page-locked ({exc}); copies from them run at pageable speed"
            log.warning(note)
            self.notes.append(note)

    # ---- each layer ---------------------------------------------------------------------------
    def gpu_side(self, layer: int) -> tuple[Any, Optional[Placement]]:
        """(GPU experts, placement) of a CPU layer: the cache's experts and residency, plus
        locked fetch's slots; (None, None) when every route goes to the CPU."""
        cached, resident = self._cached_experts(layer) or (None, None)
        if not self.locked:
            return (cached, Placement(resident)) if cached is not None else (None, None)
        e = self.cpu_layers[layer]
        o = self.options
        if self.fetch_staging is None:  # one set of slots: the CPU layers run one after another
            self.fetch_staging = FetchStaging(self.cpu_layers, o.locked_max_fetch, self.device)
        gpu = StagedFetch(e, self.registration, self.fetch_staging, self.activation, self.top_k,
                          o.locked_fetch, o.locked_max_fetch, native=self.native)  # fmt: skip
        if cached is None:  # every route missed: the first ones of the step are fetched
            return gpu, FirstRoutesPlacement(None, fetch=gpu)
        return (SplitGpuExperts(cached, resident, gpu, e.hidden),
                LockedPlacement(resident, fraction=o.locked_fetch, max_fetch=o.locked_max_fetch))

    def wrap(self, layer: int, run: Callable[[Any, Any, Any, Optional[BesideFn]], Any]) -> OverlappedExpertsFn:
        """The layer's experts function: routes recorded, streaming steps computed on the GPU
        (the beside work after them), else ``run`` (the session's own, which looks its
        executors up at each call: they are installed at start)."""

        def experts_fn(x: Any, ids: Any, w: Any, beside: Optional[BesideFn]) -> Any:
            if self.route_log is not None:
                self.route_log.record(layer, ids)
            if not self._decode and self._prompt_counts is not None and layer in self.cache.rows:  # type: ignore[union-attr]
                self._count_prompt_routes(layer, ids)
            st = self.streamer
            if self._streaming and st is not None and layer in st.layers:
                return plus_beside(st.forward(layer, x, ids, w), beside)
            return run(x, ids, w, beside)

        return OverlappedExpertsFn(experts_fn)

    def _cached_experts(self, layer: int) -> Optional[tuple[Any, Any]]:
        """(the cache's experts of ``layer``, their residency row), or None (no slots for it)."""
        cache = self.cache
        if cache is None or layer not in cache.rows:
            return None
        experts = cache.layer_experts(layer)
        return None if experts is None else (experts, cache.resident[cache.rows[layer]])

    def _count_prompt_routes(self, layer: int, ids: Any) -> None:
        """Add a prompt step's routes of a cached layer to the device-side counts (no sync;
        never inside a graph capture, whose replays are decode steps)."""
        if on_gpu(self.device) and torch.cuda.is_current_stream_capturing():
            return
        flat = ids.reshape(-1).long()
        self._prompt_counts[self.cache.rows[layer]].index_add_(  # type: ignore[index, union-attr]
            0, flat.clamp(min=0), (flat >= 0).to(torch.int32))
        self._prompt_counted = True

    # ---- each step ------------------------------------------------------------------------------
    def before_step(self, tokens: int, decode: bool, busy_ns: Optional[int]) -> None:
        last = self._last
        if last is not None and last[1] and last[0] <= self.max_decode_tokens and self.route_log is not None:
            self._after_decode(last[0])
        if self.stats is not None and busy_ns is not None:
            if self._busy_ns is not None:
                self.stats.cpu_expert_ns += busy_ns - self._busy_ns
            self._busy_ns = busy_ns
        self._last = (tokens, decode)
        self._decode = decode
        st = self.streamer
        self._streaming = st is not None and st.wants(tokens, decode)
        if self._streaming:
            st.start_step()  # type: ignore[union-attr]
        if self.stats is not None and st is not None:
            self.stats.streamed_bytes = st.streamed_bytes

    def after_capture(self) -> None:
        """Graph capture ran the layers with a dummy batch: forget it as a step."""
        self._last = None
        self._streaming = False
        self._decode = True

    def after_warmup(self) -> None:
        """The engine's warm-up prefills ran the layers with random tokens: forget them (their
        prompt routes, streamed bytes, CPU time)."""
        self.after_capture()
        self._busy_ns = None
        if self._prompt_counts is not None:
            self._prompt_counts.zero_()
        self._prompt_counted = False
        if self.streamer is not None:
            self.streamer.reset_counters()
        if self.stats is not None:
            self.stats = MoEStats(self.moe_layers, self.options.stats_interval_s)

    def _after_decode(self, tokens: int) -> None:
        ids = self.route_log.read(tokens)  # type: ignore[union-attr]
        on_gpu = np.ones(ids.shape, dtype=bool)
        cache = self.cache
        for layer in self.cpu_layers:
            on_gpu[self.route_log.index[layer]] = False  # type: ignore[union-attr]
        if cache is not None:
            if self._prompt_counted and self._prompt_counts is not None:  # the prompts since the last decode step
                cache.observe(self._prompt_counts.cpu().numpy())
                self._prompt_counts.zero_()
                self._prompt_counted = False
            rows = [self.route_log.index[layer] for layer in cache.layers]  # type: ignore[union-attr]
            on_gpu[rows] = cache.after_step(ids[rows])
        if self.locked:
            o = self.options
            for layer in self.cpu_layers:
                r = self.route_log.index[layer]  # type: ignore[union-attr]
                locked = locked_routes((ids[r] >= 0) & ~on_gpu[r], o.locked_fetch, o.locked_max_fetch)
                on_gpu[r] |= locked
                self.locked_routes += int(locked.sum())
        if self.stats is not None:
            self.stats.add_step(ids, on_gpu)
            if cache is not None:
                self.stats.fetched_bytes = cache.fetched_bytes
                self.stats.fetched_experts = cache.fetched_experts
            self.stats.maybe_log()

    # ---- report -----------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.registration is not None:
            out["host_locked_bytes"] = self.registration.bytes
        if self.cache is not None:
            out["expert_cache"] = self.cache.describe()
        if self.streamer is not None:
            out["prefill_stream"] = {"mode": self.options.stream_prefill, "experts": self.options.stream_experts,
                                     "min_tokens": self.streamer.min_tokens,
                                     "profile": self.profile.as_dict() if self.profile else None,
                                     "streamed_layers": self.streamer.streamed_layers,
                                     "streamed_bytes": self.streamer.streamed_bytes,
                                     "buffer_bytes": self.streamer.nbytes}
            if self.options.stream_experts == "routed":
                out["prefill_stream"]["routed_copies"] = "gather kernels" if self.streamer.gathers else "copy engine"
        if self.locked:
            out["locked_fetch"] = {"fraction": self.options.locked_fetch, "max_fetch": self.options.locked_max_fetch,
                                   "setting": self.locked_setting,
                                   "staging_bytes": self.fetch_staging.nbytes if self.fetch_staging else 0,
                                   "routes": self.locked_routes if self.route_log is not None else None}
            if self.fetch_profile is not None:
                out["locked_fetch"]["profile"] = self.fetch_profile.as_dict()
        elif self.cpu_layers:
            given = "off (--moe-locked-max-fetch 0)" if self.options.locked_fetch else "off (--moe-locked-fetch 0)"
            out["locked_fetch"] = {"fraction": 0.0,
                                   "setting": given if self.locked_setting == "given" else self.locked_setting}
            if self.fetch_profile is not None:
                out["locked_fetch"]["profile"] = self.fetch_profile.as_dict()
        if self.stats is not None:
            out["moe_stats"] = self.stats.snapshot()
        if self.notes:
            out["moe_notes"] = list(self.notes)
        return out

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        if self.cache is not None:
            self.cache.close()
        if self.copies is not None:
            self.copies.close()
        if on_gpu(self.device):
            torch.cuda.synchronize(self.device)
        if self.registration is not None:
            self.registration.close()
            self.registration = None
