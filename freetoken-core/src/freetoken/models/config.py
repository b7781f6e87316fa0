"""The architecture-independent description of a loaded MoE decoder."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class RecurrentStateShape:
    """The recurrent state one sequence carries through the linear-attention layers:
    per layer a short-convolution window and a state matrix per value head."""

    layers: tuple[int, ...]  # the linear-attention layers
    conv: tuple[int, ...]  # [kernel - 1, channels] per layer
    ssm: tuple[int, ...]  # [value heads, key head dim, value head dim] per layer


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What the paged KV cache holds per token and attention layer: ``heads`` K vectors of
    ``k_dim`` values and as many V vectors of ``v_dim`` (0: no separate V; multi-head latent
    attention caches one compressed latent per token that serves as both)."""

    heads: int
    k_dim: int
    v_dim: int

    def values_per_token(self) -> int:
        return self.heads * (self.k_dim + self.v_dim)


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

    def shared_expert_intermediate(self) -> int:
        """The hidden size of a MoE layer's shared experts, as the one SwiGLU they form (0:
        none, or not declared here; a family's config says)."""
        return 0

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers if self.kv_layers is None else len(self.kv_layers)

    def attention_weights(self) -> int:
        """Weights of one layer's attention projections (q, k, v, o), for the sizes estimated
        from the config before loading."""
        return self.hidden_size * self.head_dim * 2 * (self.num_heads + self.num_kv_heads)

    def kv_layout(self) -> KVLayout:
        """What the KV cache holds per token and attention layer: K and V per KV head."""
        return KVLayout(self.num_kv_heads, self.head_dim, self.head_dim)

    def kv_bytes_per_token(self, element_size: int) -> int:
        return self.num_kv_layers * self.kv_layout().values_per_token() * element_size


def hf_config_fields(cfg: dict[str, Any], eos_token_ids: tuple[int, ...], *, rms_norm_eps: float = 1e-6,
                     max_positions: int = 4096) -> dict[str, Any]:  # fmt: skip
    """The :class:`ModelConfig` fields every family reads alike from an HF ``config.json``:
    vocabulary, hidden size, layers, heads (``head_dim`` defaults to hidden / heads), norm
    epsilon, context length, tied embeddings, bos and the given eos ids. A family adds its
    own fields (and overrides any of these) when it builds its config."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", rms_norm_eps)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", max_positions)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_token_ids,
    )


def gguf_config_fields(meta: dict[str, Any], a: str, has_output: bool, *, rms_norm_eps: float = 1e-6,
                       rope_theta: float = 10000.0, max_positions: int = 4096) -> dict[str, Any]:  # fmt: skip
    """The :class:`ModelConfig` fields every family reads alike from GGUF metadata (keys
    under the architecture ``a``, as llama.cpp's converter writes them): vocabulary (-1
    when absent: the loader takes it from ``token_embd``), hidden size, ``block_count``
    layers, heads (``head_dim`` from ``attention.key_length``, else hidden / heads), norm
    epsilon, RoPE base, context length, tied embeddings (no ``output`` tensor), bos/eos."""
    from freetoken.loading.gguf import gguf_float, gguf_int

    hidden = gguf_int(meta, f"{a}.embedding_length")
    heads = gguf_int(meta, f"{a}.attention.head_count")
    vocab = meta.get(f"{a}.vocab_size")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        vocab_size=int(vocab) if vocab is not None else -1,
        hidden_size=hidden,
        num_layers=gguf_int(meta, f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=gguf_int(meta, f"{a}.attention.head_count_kv", heads),
        head_dim=gguf_int(meta, f"{a}.attention.key_length", hidden // heads),
        rms_norm_eps=gguf_float(meta, f"{a}.attention.layer_norm_rms_epsilon", rms_norm_eps),
        rope_theta=gguf_float(meta, f"{a}.rope.freq_base", rope_theta),
        max_position_embeddings=gguf_int(meta, f"{a}.context_length", max_positions),
        tie_word_embeddings=not has_output,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def hf_eos_ids(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> tuple[int, ...]:
    """End-of-sequence ids of an HF generation config, then of its ``config.json``, in
    order, each once."""
    eos: list[int] = []
    for src in (generation_config or {}, cfg):
        v = src.get("eos_token_id")
        for e in v if isinstance(v, list) else ([] if v is None else [v]):
            if int(e) not in eos:
                eos.append(int(e))
    return tuple(eos)


def check_hf_support(cfg: dict[str, Any], family: str, *, attention_bias: bool = True) -> None:
    """The HF ``config.json`` checks of the SwiGLU families: ``hidden_act`` silu, no
    projection biases (``attention_bias``, checked unless the family's config has no such
    key), and unquantized weights or FP8 with 128x128 block scales."""
    from freetoken.loading.hf import CheckpointError

    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{family} with hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    if attention_bias and cfg.get("attention_bias"):
        raise CheckpointError(f"{family} checkpoints with attention_bias=true are not supported")
    qc = cfg.get("quantization_config")
    if not qc:
        return
    method = qc.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{family}: quantization method {method!r} is not supported (HF checkpoints: BF16/FP16/FP32 or FP8 with "
            "128x128 block scales; use a GGUF file for other quantizations)")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [128, 128]:
        raise CheckpointError(f"{family}: FP8 weight_block_size {block} is not supported (128x128 only)")


def gguf_expert_fields(meta: dict[str, Any], a: str, *, ffn_fallback: bool = False) -> dict[str, Any]:
    """The routed experts' :class:`ModelConfig` fields from GGUF metadata: their hidden size
    (``expert_feed_forward_length``; with ``ffn_fallback``, ``feed_forward_length`` when
    absent, as llama's converter writes Mixtral and OLMoE), count and experts per token."""
    from freetoken.loading.gguf import gguf_int

    key = f"{a}.expert_feed_forward_length"
    if ffn_fallback and key not in meta:
        key = f"{a}.feed_forward_length"
    return dict(moe_intermediate_size=gguf_int(meta, key), num_experts=gguf_int(meta, f"{a}.expert_count"),
                top_k=gguf_int(meta, f"{a}.expert_used_count"))  # fmt: skip
