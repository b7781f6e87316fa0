"""Engine configuration (shared by the Python API, the CLI and the server)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from freetoken.backends.contract import EngineOptions
from freetoken.moe.placement import parse_layer_spec


@dataclasses.dataclass
class EngineConfig:
    """How to run one model.

    ``model`` is an HF directory or a ``.gguf`` path; ``None`` selects the built-in
    demo model (created on first use). ``max_model_len`` defaults to the
    checkpoint's context, capped by the KV budget ``kv_cache_tokens`` (default: enough
    for ``max_running_requests`` full-length sequences, capped by a quarter of the
    RAM left after the weights). ``prefill_chunk`` is the most prompt tokens one step
    computes, so a long prompt does not stall running decodes.
    ``enable_prefix_cache`` shares the full KV blocks of equal token prefixes between
    requests (:mod:`freetoken.engine.prefix_cache`).
    """

    model: Optional[str] = None
    backend: Optional[str] = None
    max_model_len: Optional[int] = None
    max_running_requests: int = 16
    max_queued_requests: int = 256
    kv_cache_tokens: Optional[int] = None
    prefill_chunk: int = 256
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    seed: int = 0
    kv_block_size: int = 16
    moe_cpu_layers: Optional[str] = None
    cpu_threads: Optional[int] = None
    enforce_eager: bool = False
    cuda_graph_max_bs: int = 16
    cuda_graph_bs: Optional[list[int]] = None
    gpu_memory_utilization: Optional[float] = None
    gpu_memory_limit: Optional[int] = None
    enable_prefix_cache: bool = True

    def backend_options(self, act_dtype: Any) -> EngineOptions:
        """What the backend's model session acts on."""
        return EngineOptions(
            act_dtype=act_dtype, moe_cpu_layers=self.moe_cpu_layers, cpu_threads=self.cpu_threads,
            graphs=not self.enforce_eager, graph_batch_sizes=self.cuda_graph_bs,
            graph_max_batch_size=self.cuda_graph_max_bs, gpu_memory_limit=self.gpu_memory_limit,
            gpu_memory_utilization=self.gpu_memory_utilization, max_running_requests=self.max_running_requests,
            max_model_len=self.max_model_len or 0, kv_block_size=self.kv_block_size,
        )

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.kv_block_size:
            raise ValueError(f"kv_cache_tokens must be >= {self.kv_block_size}")
        if self.moe_cpu_layers is not None:
            parse_layer_spec(self.moe_cpu_layers)  # syntax now; layer indices once the model is known
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and any(b < 1 for b in self.cuda_graph_bs):
            raise ValueError(f"cuda_graph_bs must hold batch sizes >= 1, got {self.cuda_graph_bs}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit < 1:
            raise ValueError(f"gpu_memory_limit must be a positive number of bytes, got {self.gpu_memory_limit}")
