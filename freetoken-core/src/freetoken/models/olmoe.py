"""OLMoE (HF ``OlmoeForCausalLM``, GGUF architecture ``olmoe``).

GQA attention whose q and k projections are RMS-normalised over their whole width (all
heads together) before RoPE, optional q/k/v clipping, NeoX RoPE, RMSNorm pre-norms,
softmax routing over every expert with the top-k weights renormalised only when
``norm_topk_prob``, SwiGLU experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from freetoken.loading.hf import CheckpointError
from freetoken.models.config import ModelConfig, gguf_config_fields, hf_config_fields
from freetoken.models.mixtral import check_hf_quantization
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, Names, hf_eos_ids, swiglu_experts
from freetoken.models.rope import scaling_from_hf

ARCHITECTURE = "olmoe"
HF_ARCHITECTURES = ("OlmoeForCausalLM",)
GGUF_ARCHITECTURES = ("olmoe",)


@dataclasses.dataclass
class OlmoeConfig(ModelConfig):
    clip_qkv: Optional[float] = None


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> OlmoeConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"OLMoE with hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("attention_bias"):
        raise CheckpointError("OLMoE with attention_bias=true is not supported")
    check_hf_quantization(cfg, "OLMoE")
    theta, scaling = scaling_from_hf(cfg)
    if scaling.kind != "default":
        raise CheckpointError(f"OLMoE with RoPE scaling {scaling.kind!r} is not supported (default RoPE only)")
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
        rope_theta=theta,
        clip_qkv=float(clip) if clip is not None else None,
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> OlmoeConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "olmoe")
    clamp = meta.get(f"{a}.attention.clamp_kqv")
    fields = gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-5)
    fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    return OlmoeConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=0,
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length", None)
        if f"{a}.expert_feed_forward_length" in meta else gguf_int(meta, f"{a}.feed_forward_length"),
        num_experts=gguf_int(meta, f"{a}.expert_count"),
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", False)),
        clip_qkv=float(clamp) if clamp else None,
    )


_HF_ROLES = {
    "in_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "router": "mlp.gate.weight",
}
_GGUF_ROLES = {
    "in_norm": "attn_norm.weight",
    "post_norm": "ffn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "router": "ffn_gate_inp.weight",
}

HF_NAMES = Names(embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
                 layer=lambda i, r: f"model.layers.{i}.{_HF_ROLES[r]}", fmt="hf")
GGUF_NAMES = Names(embed="token_embd.weight", norm="output_norm.weight", lm_head="output.weight",
                   layer=lambda i, r: f"blk.{i}.{_GGUF_ROLES[r]}", fmt="gguf")


def _experts(i: int, source: Any, names: Names, c: ModelConfig) -> tuple[Any, None]:
    per_expert = lambda l, e, r: f"model.layers.{l}.mlp.experts.{e}.{r}_proj.weight"  # noqa: E731
    fused = lambda l, r: f"model.layers.{l}.mlp.experts.{r}_proj"  # noqa: E731
    return swiglu_experts(i, source, names, c, per_expert, fused), None


class OlmoeModel(MoeDecoderModel):
    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        return Arch(experts=_experts, qk_norm="full", clip_qkv=getattr(config, "clip_qkv", None))
