"""Engine configuration (shared by the Python API, the CLI and the server)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class EngineConfig:
    """How to run one model.

    ``model`` is an HF directory or a ``.gguf`` path; ``None`` selects the built-in
    demo model (created on first use). ``max_model_len`` defaults to the
    checkpoint's context, capped by the KV budget ``kv_cache_tokens`` (default: enough
    for ``max_running_requests`` full-length sequences, capped by a quarter of the
    RAM left after the weights). ``prefill_chunk`` is the most prompt tokens one step
    computes, so a long prompt does not stall running decodes.
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
