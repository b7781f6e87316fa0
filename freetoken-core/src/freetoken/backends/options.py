"""The engine's settings a backend receives when it opens a model (carried as data):
:class:`EngineOptions`, with the routed experts' :class:`MoEOptions`. The command line fills
them (``freetoken serve --help``; docs/engine.md lists every option)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


#: prompt tokens a step computes by default on the CPU: its prompt kernels are bound by the
#: products, so a larger chunk gains little and stalls the running decodes longer
CPU_PREFILL_CHUNK = 256
#: ... and on a GPU: the grouped expert kernels pass over each routed expert's weights once
#: a step whatever its tokens (a layer of 128 tokens takes nearly as long as one of 512), and
#: a hybrid step that streams the CPU layers' experts copies them once a chunk, so small
#: chunks cost most of the prompt rate
GPU_PREFILL_CHUNK = 2048


@dataclasses.dataclass
class MoEOptions:
    """How a GPU backend keeps and moves routed experts (``freetoken serve --moe-*``).

    ``gpu_experts``: the form of GPU-resident experts: ``auto`` keeps GGUF block formats
    the GPU kernels read (Q4_K, Q5_K, Q6_K, Q8_0) packed, as in the file, and dequantizes
    the others to the activation dtype; ``dequantized`` always dequantizes.
    ``cache_bytes`` / ``cache_fraction``: the global expert cache for the CPU layers' experts
    (bytes, or a fraction of the memory budget; 0: none); ``cache_auto`` (with neither given):
    a planned placement's spare device memory, what its KV cache leaves of the budget (see
    :meth:`freetoken.backends.contract.ModelSession.kv_cache_allocated`). ``hybrid_max_fetch``: experts
    per layer and step copied into the cache for later steps (the most routed uncached ones,
    each replacing a clearly less routed cached one; ``freetoken.moe.experts.expert_cache``).
    ``stream_prefill``: ``auto`` (prefill chunks of at least ``stream_min_tokens`` tokens
    compute the CPU layers' experts on the GPU, their bytes streamed over PCIe; None: the
    threshold from a measured profile), ``on``, ``off``; ``stream_experts``: ``routed`` copies
    only the experts the chunk routes to, once its router has run, ``all`` every expert of
    the layer, the next layer's copy overlapping this one's compute; ``stream_windows``:
    ``routed`` streams a layer in this many windows of experts through one buffer of a
    window's bytes (more windows: less device memory). ``lock_host``: register (page-lock)
    the host expert banks with the driver (``auto``: when streaming or fetching uses them).
    ``locked_fetch``: share of a decode step's missed routes that the GPU computes from the
    page-locked banks in the same step (at most ``locked_max_fetch`` per layer; 0: off; None:
    ``auto``, :func:`freetoken.moe.experts.locked_fetch.planned_fraction`), its kernels reading them
    from device slots a gather kernel first copies them into.
    ``collect_stats`` with the log summary every ``stats_interval_s`` seconds.
    ``gpu_kernel``: what runs a decode step's routes through packed GPU experts: ``native``
    (the backend's :meth:`PackedGemv.experts`), ``triton`` (the engine's Triton kernels), or
    ``auto`` (native for the formats and shapes it serves, where the backend has it).
    """

    gpu_experts: str = "auto"
    cache_bytes: int = 0
    cache_fraction: float = 0.0
    cache_auto: bool = False
    hybrid_max_fetch: int = 0
    stream_prefill: str = "auto"
    stream_min_tokens: Optional[int] = None
    stream_experts: str = "routed"
    stream_windows: int = 4
    lock_host: str = "auto"
    locked_fetch: Optional[float] = None
    locked_max_fetch: int = 2
    collect_stats: bool = False
    stats_interval_s: float = 60.0
    gpu_kernel: str = "auto"



@dataclasses.dataclass
class EngineOptions:
    """The engine settings a backend acts on (from ``freetoken serve``/``generate``/``bench``).

    ``moe_cpu_layers``: which layers' routed experts run on the CPU workers: a count (the
    first N MoE layers), a list/range of layer indices (``"0-11,40"``) or ``"all"``
    (:func:`freetoken.moe.placement.cpu_layers`); None is the backend's default (a GPU
    backend: as many layers on the GPU as the memory allows).
    ``cpu_threads``: CPU expert workers (None: the backend's default).
    ``cpu_spin_ms``: how long the CPU expert workers spin after a hand-off before they sleep
    (None: longer than a decode step on a GPU device, the CPU experts' default elsewhere).
    ``graphs``: decode-graph settings; ``graph_batch_sizes`` an explicit list of buckets,
    else powers of two (and multiples of 8) up to ``graph_max_batch_size``.
    ``gpu_memory_limit`` (bytes) and ``gpu_memory_utilization`` (fraction of the device's
    total): the most this process may use on the device; the smaller wins.
    ``gpu_dense``: the form of the dense part on the device: ``dequantized`` (the activation
    dtype), ``packed`` (a GGUF file's block formats kept as in the file), ``both`` (packed,
    plus copies at the activation dtype of its linears but the head, which prompts use), or
    ``auto`` (packed when that lets more layers' experts onto the device, or is needed to fit).
    ``gpu_embedding``: where a packed token embedding's table lives: ``device``, ``host``
    (page-locked host memory the GPU reads a step's rows from over PCIe; not for an embedding
    that is also the output head), or ``auto`` (host when the memory plan leaves layers'
    experts on the CPU, so its bytes go to expert layers instead).
    ``gpu_gemv``: what runs one token through a packed dense matrix: ``native`` (the
    backend's :class:`PackedGemv`), ``triton`` (the engine's Triton kernels), or ``auto``
    (native for the formats it serves, where the backend has one).
    ``pin_host_threads``: ``on`` (on a GPU device whose model has CPU expert layers, the
    threads that step the model and enqueue expert copies run on the CPUs the expert
    workers leave free, :mod:`freetoken.moe.session.host_threads`) or ``off``.
    """

    act_dtype: Any = None
    moe_cpu_layers: Optional[str] = None
    cpu_threads: Optional[int] = None
    cpu_spin_ms: Optional[float] = None
    graphs: bool = True
    graph_batch_sizes: Optional[list[int]] = None
    graph_max_batch_size: int = 64
    gpu_memory_limit: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    max_running_requests: int = 16
    max_model_len: int = 4096
    kv_block_size: int = 16
    kv_cache_tokens: Optional[int] = None  # an explicit KV cache size (the plan keeps room for it)
    #: the most prompt tokens one step computes (None: :meth:`prompt_chunk`'s default); a GPU
    #: session's memory plan may lower it to the chunk whose activations it holds
    #: (ModelSession.prefill_chunk)
    prefill_chunk: Optional[int] = None
    gpu_dense: str = "auto"
    gpu_embedding: str = "auto"
    gpu_gemv: str = "auto"
    pin_host_threads: str = "on"
    moe: MoEOptions = dataclasses.field(default_factory=lambda: MoEOptions())

    def prompt_chunk(self, gpu: bool) -> int:
        """The prompt chunk asked for: ``prefill_chunk``, else :data:`GPU_PREFILL_CHUNK` on a
        GPU device and :data:`CPU_PREFILL_CHUNK` elsewhere."""
        if self.prefill_chunk:
            return int(self.prefill_chunk)
        return GPU_PREFILL_CHUNK if gpu else CPU_PREFILL_CHUNK

