"""The architecture-independent description of a loaded MoE decoder."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RecurrentStateShape:
    """The recurrent state one sequence carries through the linear-attention layers:
    per layer a short-convolution window and a state matrix per value head."""

    layers: tuple[int, ...]  # the linear-attention layers
    conv: tuple[int, ...]  # [kernel - 1, channels] per layer
    ssm: tuple[int, ...]  # [value heads, key head dim, value head dim] per layer


@dataclasses.dataclass
class ModelConfig:
    """Shapes and hyper-parameters the engine and the model code need.

    Family-specific knobs live in the family module; these fields are what the
    engine (KV cache, scheduler, sampling) reads.
    """

    architecture: str  # registry key, e.g. "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers (0: none)
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    #: layers that attend over the paged KV cache (None: every layer); the KV cache holds
    #: one K/V pair per entry, in this order
    kv_layers: Optional[tuple[int, ...]] = None
    #: per-request recurrent state of linear-attention layers (None: the model has none)
    recurrent: Optional[RecurrentStateShape] = None

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % max(1, self.decoder_sparse_step) == 0
        )

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers if self.kv_layers is None else len(self.kv_layers)

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * element_size
