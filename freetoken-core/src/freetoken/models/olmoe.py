"""OLMoE (HF ``OlmoeForCausalLM``, GGUF architecture ``olmoe``).

GQA attention whose q and k projections are RMS-normalised over their whole width (all
heads together) before RoPE, optional q/k/v clipping, NeoX RoPE, RMSNorm pre-norms,
softmax routing over every expert with the top-k weights renormalised only when
``norm_topk_prob``, SwiGLU experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from freetoken.models.config import ModelConfig, check_hf_support, hf_config_fields, hf_eos_ids
from freetoken.models.config import gguf_config_fields, gguf_expert_fields
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, swiglu_experts_builder
from freetoken.models.rope import default_rope_theta
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, gguf_names
from freetoken.models.tensor_names import HF_ATTENTION_ROLES, HF_MLP_ROLES, hf_names

ARCHITECTURE = "olmoe"
HF_ARCHITECTURES = ("OlmoeForCausalLM",)
GGUF_ARCHITECTURES = ("olmoe",)


@dataclasses.dataclass
class OlmoeConfig(ModelConfig):
    clip_qkv: Optional[float] = None


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> OlmoeConfig:
    check_hf_support(cfg, "OLMoE")
    clip = cfg.get("clip_qkv")
    fields = hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-5)
    fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]  # OLMoE has no separate head_dim
    return OlmoeConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=0,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        num_experts=int(cfg["num_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rope_theta=default_rope_theta(cfg, "OLMoE"),
        clip_qkv=float(clip) if clip is not None else None,
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> OlmoeConfig:
    a = meta.get("general.architecture", "olmoe")
    clamp = meta.get(f"{a}.attention.clamp_kqv")
    fields = gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-5)
    fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    return OlmoeConfig(
        architecture=ARCHITECTURE,
        **fields,
        **gguf_expert_fields(meta, a, ffn_fallback=True),
        intermediate_size=0,
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", False)),
        clip_qkv=float(clamp) if clamp else None,
    )


HF_NAMES = hf_names({**HF_ATTENTION_ROLES, **HF_MLP_ROLES})
GGUF_NAMES = gguf_names({**GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES})
_experts = swiglu_experts_builder(lambda l, e, r: f"model.layers.{l}.mlp.experts.{e}.{r}_proj.weight")


class OlmoeModel(MoeDecoderModel):
    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        return Arch(experts=_experts, qk_norm="full", clip_qkv=getattr(config, "clip_qkv", None))
