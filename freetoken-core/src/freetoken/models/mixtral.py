"""Mixtral (HF ``MixtralForCausalLM``; GGUF architecture ``llama`` with experts).

GQA attention without q/k norms, NeoX RoPE, an optional sliding window on every layer,
RMSNorm pre-norms, softmax routing renormalised over the top-k, SwiGLU experts
(``w1`` gate, ``w3`` up, ``w2`` down). llama.cpp's converter writes Mixtral as its
``llama`` architecture with stacked ``ffn_*_exps`` tensors and q/k rows permuted for
interleaved RoPE, which the loader undoes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from freetoken.loading.hf import CheckpointError
from freetoken.models.config import ModelConfig, gguf_config_fields, hf_config_fields
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, Names, hf_eos_ids, swiglu_experts
from freetoken.models.rope import scaling_from_hf

ARCHITECTURE = "mixtral"
HF_ARCHITECTURES = ("MixtralForCausalLM",)
GGUF_ARCHITECTURES = ("llama",)


@dataclasses.dataclass
class MixtralConfig(ModelConfig):
    sliding_window: Optional[int] = None


def check_hf_quantization(cfg: dict[str, Any], family: str) -> None:
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


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> MixtralConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"Mixtral with hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    check_hf_quantization(cfg, "Mixtral")
    theta, scaling = scaling_from_hf(cfg)
    if scaling.kind != "default":
        raise CheckpointError(f"Mixtral with RoPE scaling {scaling.kind!r} is not supported (default RoPE only)")
    window = cfg.get("sliding_window")
    return MixtralConfig(
        architecture=ARCHITECTURE,
        **hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-5),
        intermediate_size=0,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=True,
        rope_theta=theta,
        sliding_window=int(window) if window else None,
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> MixtralConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "llama")
    experts = int(meta.get(f"{a}.expert_count", 0) or 0)
    if experts == 0:
        raise CheckpointError(
            f"GGUF architecture {a!r} without experts (a dense Llama) is not supported; FreeToken runs MoE models "
            "(a llama file with expert_count > 0 is Mixtral)")
    if meta.get(f"{a}.rope.scaling.type", "none") not in ("none", "linear") or \
            float(meta.get(f"{a}.rope.scaling.factor", 1.0) or 1.0) != 1.0:
        raise CheckpointError(f"{a}: RoPE scaling {meta.get(f'{a}.rope.scaling.type')!r} is not supported")
    fields = gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-5)
    rope_dim = gguf_int(meta, f"{a}.rope.dimension_count", fields["hidden_size"] // fields["num_heads"])
    fields["head_dim"] = gguf_int(meta, f"{a}.attention.key_length", rope_dim)
    return MixtralConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=0,
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length", None)
        if f"{a}.expert_feed_forward_length" in meta else gguf_int(meta, f"{a}.feed_forward_length"),
        num_experts=experts,
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        norm_topk_prob=True,
    )


_HF_ROLES = {
    "in_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
}
_GGUF_ROLES = {
    "in_norm": "attn_norm.weight",
    "post_norm": "ffn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "router": "ffn_gate_inp.weight",
}
_HF_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def _hf_layer(i: int, role: str) -> str:
    if role == "router":
        return f"model.layers.{i}.block_sparse_moe.gate.weight"
    return f"model.layers.{i}.{_HF_ROLES[role]}"


HF_NAMES = Names(embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
                 layer=_hf_layer, fmt="hf")
GGUF_NAMES = Names(embed="token_embd.weight", norm="output_norm.weight", lm_head="output.weight",
                   layer=lambda i, r: f"blk.{i}.{_GGUF_ROLES[r]}", fmt="gguf")


def _experts(i: int, source: Any, names: Names, c: ModelConfig) -> tuple[Any, None]:
    per_expert = lambda l, e, r: f"model.layers.{l}.block_sparse_moe.experts.{e}.{_HF_EXPERT[r]}.weight"  # noqa: E731
    fused = lambda l, r: f"model.layers.{l}.mlp.experts.{r}_proj"  # noqa: E731
    return swiglu_experts(i, source, names, c, per_expert, fused), None


class MixtralModel(MoeDecoderModel):
    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        window = getattr(config, "sliding_window", None)
        return Arch(experts=_experts, windows=(window,) * config.num_layers if window else (), unpermute_qk=True)
