"""Qwen3.5-MoE / Qwen3.6-MoE (HF ``Qwen3_5MoeForConditionalGeneration`` and
``Qwen3_5MoeForCausalLM``, GGUF architecture ``qwen35moe``): three of every four layers
Gated DeltaNet, one gated full attention; routed experts (top-k always renormalised) plus
a gated shared expert in every layer. The model is :mod:`freetoken.models.qwen_hybrid`;
this module reads the configs. Only the text model is loaded (the vision tower and the
multi-token-prediction layers of the checkpoints are not used).
"""

from __future__ import annotations

from typing import Any, Optional

from freetoken.models.config import check_hf_support, gguf_config_fields, hf_config_fields, hf_eos_ids
from freetoken.models.qwen_hybrid import FULL, GGUF_NAMES, HF_NAMES, LINEAR, HybridConfig, QwenHybridModel
from freetoken.models.qwen_hybrid import finish_config
from freetoken.models.rope import default_rope_theta, hf_rope_parameters

ARCHITECTURE = "qwen3_5_moe"
HF_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
GGUF_ARCHITECTURES = ("qwen35moe",)

__all__ = ["Qwen35MoeModel", "config_from_hf", "config_from_gguf", "HF_NAMES", "GGUF_NAMES"]


class Qwen35MoeModel(QwenHybridModel):
    hf_fused_qkvz = False


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (multimodal checkpoints nest it under ``text_config``)."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        return cfg
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    return text


def hybrid_config(architecture: str, cfg: dict[str, Any], gen: Optional[dict[str, Any]], family: str,
                  **extra: Any) -> HybridConfig:  # fmt: skip
    check_hf_support(cfg, family)
    theta = default_rope_theta(cfg, family)
    rope = hf_rope_parameters(cfg)
    fields = hf_config_fields(cfg, hf_eos_ids(cfg, gen))
    head_dim, n = fields["head_dim"], fields["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    c = HybridConfig(
        architecture=architecture,
        **fields,
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts=int(cfg["num_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        rope_theta=theta,
        layer_types=tuple(types),
        linear_key_heads=int(cfg["linear_num_key_heads"]),
        linear_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_dim=int(cfg["linear_key_head_dim"]),
        linear_value_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        rotary_dim=int(head_dim * factor),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        **extra,
    )
    return finish_config(c, family)


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> HybridConfig:
    # Qwen3.5's router always renormalises its top-k weights
    return hybrid_config(ARCHITECTURE, text_config(cfg), generation_config, "Qwen3.5-MoE", norm_topk_prob=True)


def gguf_hybrid_config(architecture: str, meta: dict[str, Any], has_output: bool, **extra: Any) -> HybridConfig:
    """The hyper-parameters llama.cpp's converter writes for ``qwen3next``/``qwen35moe``."""
    from freetoken.loading.gguf import gguf_int

    a = str(meta.get("general.architecture"))
    fields = gguf_config_fields(meta, a, has_output)
    head_dim = fields["head_dim"]
    # multi-token-prediction layers are appended to block_count; they are not run
    n = fields["num_layers"] = fields["num_layers"] - gguf_int(meta, f"{a}.nextn_predict_layers", 0)
    recurrent = meta.get(f"{a}.attention.recurrent_layers")
    if recurrent is not None:
        types = tuple(LINEAR if bool(r) else FULL for r in list(recurrent)[:n])
    else:
        interval = gguf_int(meta, f"{a}.full_attention_interval", 4)
        types = tuple(LINEAR if (i + 1) % interval else FULL for i in range(n))
    v_heads = gguf_int(meta, f"{a}.ssm.time_step_rank")
    c = HybridConfig(
        architecture=architecture,
        **fields,
        intermediate_size=gguf_int(meta, f"{a}.feed_forward_length", 0),
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length"),
        num_experts=gguf_int(meta, f"{a}.expert_count"),
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        layer_types=types,
        linear_key_heads=gguf_int(meta, f"{a}.ssm.group_count"),
        linear_value_heads=v_heads,
        linear_key_dim=gguf_int(meta, f"{a}.ssm.state_size"),
        linear_value_dim=gguf_int(meta, f"{a}.ssm.inner_size") // max(1, v_heads),
        conv_kernel=gguf_int(meta, f"{a}.ssm.conv_kernel", 4),
        rotary_dim=gguf_int(meta, f"{a}.rope.dimension_count", head_dim // 4),
        shared_expert_intermediate_size=gguf_int(meta, f"{a}.expert_shared_feed_forward_length", 0),
        **extra,
    )
    return finish_config(c, str(meta.get("general.name") or a))


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> HybridConfig:
    # llama.cpp's converter writes Qwen3.5's value heads tiled over the key heads
    return gguf_hybrid_config(ARCHITECTURE, meta, has_output, norm_topk_prob=True, value_heads_tiled=True)
