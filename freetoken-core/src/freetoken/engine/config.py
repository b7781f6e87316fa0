"""Engine configuration (shared by the Python API, the CLI and the server)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from freetoken.backends.options import EngineOptions, MoEOptions
from freetoken.moe.placement import parse_layer_spec


@dataclasses.dataclass
class EngineConfig:
    """How to run one model.

    ``model`` is an HF directory or a ``.gguf`` path; ``None`` selects the built-in
    demo model (created on first use). ``max_model_len`` defaults to the
    checkpoint's context, capped by the KV budget ``kv_cache_tokens`` (default: enough
    for ``max_running_requests`` full-length sequences, capped by a quarter of the
    RAM left after the weights). ``prefill_chunk`` is the most prompt tokens one step
    computes, so a long prompt does not stall running decodes (None: the session's default,
    :meth:`freetoken.backends.options.EngineOptions.prompt_chunk`). ``cuda_graph_max_bs``
    bounds the decode batches captured as graphs; batches above ``max_running_requests``
    never run, so none is captured for them.
    ``enable_prefix_cache`` shares the full KV blocks of equal token prefixes between
    requests (:mod:`freetoken.engine.prefix_cache`).
    """

    model: Optional[str] = None
    backend: Optional[str] = None
    max_model_len: Optional[int] = None
    max_running_requests: int = 16
    max_queued_requests: int = 256
    kv_cache_tokens: Optional[int] = None
    prefill_chunk: Optional[int] = None
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    #: the KV cache's dtype (``auto``: the activation dtype); another one is the CPU
    #: backend's only (e.g. bfloat16 beside float32 activations: half the cache's bytes)
    kv_cache_dtype: str = "auto"
    seed: int = 0
    kv_block_size: int = 16
    moe_cpu_layers: Optional[str] = None
    cpu_threads: Optional[int] = None
    cpu_spin_ms: Optional[float] = None
    enforce_eager: bool = False
    #: launch each greedy decode step before the previous step's tokens are read back
    #: (sessions that support it: GPU backends), so the host's work between steps overlaps
    #: the device's
    decode_ahead: bool = True
    cuda_graph_max_bs: int = 64
    cuda_graph_bs: Optional[list[int]] = None
    gpu_memory_utilization: Optional[float] = None
    gpu_memory_limit: Optional[int] = None
    enable_prefix_cache: bool = True
    gpu_dense: str = "auto"
    gpu_embedding: str = "auto"
    gpu_gemv: str = "auto"
    pin_host_threads: str = "on"
    moe_gpu_experts: str = "auto"
    moe_gpu_kernel: str = "auto"
    #: bytes when >= 1, a fraction of the GPU memory budget when below 1, or "auto" (the
    #: device memory a planned placement leaves beside its layers and the KV cache)
    moe_cache_size: Union[float, str] = "auto"
    moe_hybrid_max_fetch: int = 0
    moe_stream_prefill: str = "auto"
    moe_stream_min_tokens: Optional[int] = None
    moe_stream_experts: str = "routed"
    moe_stream_windows: int = 4
    moe_lock_host: str = "auto"
    #: a fraction, or None: auto (on where the GPU can fetch, NVIDIA only)
    moe_locked_fetch: Optional[float] = None
    moe_locked_max_fetch: int = 2
    moe_collect_stats: bool = False
    moe_stats_interval: float = 60.0

    def backend_options(self, act_dtype: Any) -> EngineOptions:
        """What the backend's model session acts on."""
        cache = 0.0 if self.moe_cache_size == "auto" else float(self.moe_cache_size)
        return EngineOptions(
            act_dtype=act_dtype, moe_cpu_layers=self.moe_cpu_layers, cpu_threads=self.cpu_threads,
            cpu_spin_ms=self.cpu_spin_ms,
            graphs=not self.enforce_eager, graph_batch_sizes=self.cuda_graph_bs,
            graph_max_batch_size=self.cuda_graph_max_bs, gpu_memory_limit=self.gpu_memory_limit,
            gpu_memory_utilization=self.gpu_memory_utilization, max_running_requests=self.max_running_requests,
            max_model_len=self.max_model_len or 0, kv_block_size=self.kv_block_size,
            kv_cache_tokens=self.kv_cache_tokens, prefill_chunk=self.prefill_chunk, gpu_dense=self.gpu_dense,
            gpu_embedding=self.gpu_embedding, gpu_gemv=self.gpu_gemv,
            pin_host_threads=self.pin_host_threads,
            moe=MoEOptions(
                gpu_experts=self.moe_gpu_experts,
                cache_bytes=int(cache) if cache >= 1 else 0,
                cache_fraction=cache if cache < 1 else 0.0,
                cache_auto=self.moe_cache_size == "auto",
                hybrid_max_fetch=self.moe_hybrid_max_fetch, stream_prefill=self.moe_stream_prefill,
                stream_min_tokens=self.moe_stream_min_tokens, stream_experts=self.moe_stream_experts,
                stream_windows=self.moe_stream_windows,
                lock_host=self.moe_lock_host,
                locked_fetch=self.moe_locked_fetch, locked_max_fetch=self.moe_locked_max_fetch,
                collect_stats=self.moe_collect_stats, stats_interval_s=self.moe_stats_interval,
                gpu_kernel=self.moe_gpu_kernel,
            ),
        )

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.kv_block_size:
            raise ValueError(f"kv_cache_tokens must be >= {self.kv_block_size}")
        if self.moe_cpu_layers is not None:
            parse_layer_spec(self.moe_cpu_layers)  # syntax now; layer indices once the model is known
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_spin_ms is not None and not 0 <= self.cpu_spin_ms <= 1000:
            raise ValueError(f"cpu_spin_ms must be in [0, 1000], got {self.cpu_spin_ms}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and any(b < 1 for b in self.cuda_graph_bs):
            raise ValueError(f"cuda_graph_bs must hold batch sizes >= 1, got {self.cuda_graph_bs}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name, value, allowed in (("gpu_dense", self.gpu_dense, ("auto", "packed", "dequantized", "both")),
                                     ("gpu_embedding", self.gpu_embedding, ("auto", "device", "host")),
                                     ("gpu_gemv", self.gpu_gemv, ("auto", "native", "triton")),
                                     ("pin_host_threads", self.pin_host_threads, ("on", "off")),
                                     ("moe_gpu_experts", self.moe_gpu_experts, ("auto", "dequantized")),
                                     ("moe_gpu_kernel", self.moe_gpu_kernel, ("auto", "native", "triton")),
                                     ("moe_stream_prefill", self.moe_stream_prefill, ("auto", "on", "off")),
                                     ("moe_stream_experts", self.moe_stream_experts, ("routed", "all")),
                                     ("moe_lock_host", self.moe_lock_host, ("auto", "on", "off"))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        size = self.moe_cache_size
        if size != "auto" if isinstance(size, str) else not size >= 0:
            raise ValueError(f"moe_cache_size must be >= 0 (bytes, or a fraction below 1) or 'auto', got "
                             f"{self.moe_cache_size!r}")
        if self.moe_locked_fetch is not None and not 0 <= self.moe_locked_fetch <= 1:
            raise ValueError(f"moe_locked_fetch must be a fraction in [0, 1], got {self.moe_locked_fetch}")
        if self.moe_locked_max_fetch < 0:
            raise ValueError(f"moe_locked_max_fetch must be >= 0, got {self.moe_locked_max_fetch}")
        if self.moe_hybrid_max_fetch < 0:
            raise ValueError(f"moe_hybrid_max_fetch must be >= 0, got {self.moe_hybrid_max_fetch}")
        if self.moe_stream_windows < 1:
            raise ValueError(f"moe_stream_windows must be >= 1, got {self.moe_stream_windows}")
        if self.moe_stream_min_tokens is not None and self.moe_stream_min_tokens < 1:
            raise ValueError(f"moe_stream_min_tokens must be >= 1, got {self.moe_stream_min_tokens}")
        if not self.moe_stats_interval > 0:
            raise ValueError(f"moe_stats_interval must be > 0, got {self.moe_stats_interval}")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit < 1:
            raise ValueError(f"gpu_memory_limit must be a positive number of bytes, got {self.gpu_memory_limit}")
