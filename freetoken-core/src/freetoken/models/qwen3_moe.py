"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``, GGUF architecture ``qwen3moe``).

GQA attention with per-head q/k RMSNorm and NeoX RoPE, RMSNorm pre-norms, top-k
softmax routing (``norm_topk_prob``) over SwiGLU experts, tied or untied
embeddings; dense-MLP layers where ``mlp_only_layers``/``decoder_sparse_step`` say.
The model is :class:`~freetoken.models.moe_decoder.MoeDecoderModel` with per-head q/k norms.
"""

from __future__ import annotations

from typing import Any, Optional

from freetoken.loading.hf import CheckpointError
from freetoken.models.config import ModelConfig, check_hf_support, hf_config_fields, hf_eos_ids
from freetoken.models.config import gguf_config_fields, gguf_expert_fields
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, swiglu_experts_builder
from freetoken.models.rope import default_rope_theta
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, gguf_names
from freetoken.models.tensor_names import HF_ATTENTION_ROLES, HF_MLP_ROLES, hf_names

ARCHITECTURE = "qwen3_moe"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3moe",)


# ------------------------------------------------------------------------ configs


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> ModelConfig:
    check_hf_support(cfg, "Qwen3-MoE")
    if cfg.get("use_sliding_window"):
        raise CheckpointError("Qwen3-MoE with use_sliding_window=true is not supported (full attention only)")
    return ModelConfig(
        architecture=ARCHITECTURE,
        **hf_config_fields(cfg, hf_eos_ids(cfg, generation_config)),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rope_theta=default_rope_theta(cfg, "Qwen3-MoE"),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> ModelConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "qwen3moe")
    return ModelConfig(
        architecture=ARCHITECTURE,
        **gguf_config_fields(meta, a, has_output),  # vocab_size -1 when absent: filled from token_embd
        **gguf_expert_fields(meta, a),
        intermediate_size=gguf_int(meta, f"{a}.feed_forward_length", 0),
        # llama.cpp always renormalises the top-k weights for qwen3moe.
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
    )


# ------------------------------------------------------------------ tensor names

HF_NAMES = hf_names({**HF_ATTENTION_ROLES, **HF_MLP_ROLES})
GGUF_NAMES = gguf_names({**GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES})


_experts = swiglu_experts_builder(lambda l, e, r: f"model.layers.{l}.mlp.experts.{e}.{r}_proj.weight")


# ------------------------------------------------------------------------ model


class Qwen3MoeModel(MoeDecoderModel):
    """The runnable model: weights placed by a :class:`WeightPolicy`, forward over a
    flat batch of tokens with paged KV."""

    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        return Arch(experts=_experts, qk_norm="head")
