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
from freetoken.models.config import ModelConfig, check_hf_support, hf_config_fields, hf_eos_ids
from freetoken.models.config import gguf_config_fields, gguf_expert_fields
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, swiglu_experts_builder
from freetoken.models.rope import default_rope_theta
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, HF_ATTENTION_ROLES, gguf_names, hf_names

ARCHITECTURE = "mixtral"
HF_ARCHITECTURES = ("MixtralForCausalLM",)
GGUF_ARCHITECTURES = ("llama",)


@dataclasses.dataclass
class MixtralConfig(ModelConfig):
    sliding_window: Optional[int] = None


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> MixtralConfig:
    check_hf_support(cfg, "Mixtral", attention_bias=False)
    window = cfg.get("sliding_window")
    return MixtralConfig(
        architecture=ARCHITECTURE,
        **hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-5),
        intermediate_size=0,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=True,
        rope_theta=default_rope_theta(cfg, "Mixtral"),
        sliding_window=int(window) if window else None,
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> MixtralConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "llama")
    if not int(meta.get(f"{a}.expert_count", 0) or 0):
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
        **gguf_expert_fields(meta, a, ffn_fallback=True),
        intermediate_size=0,
        norm_topk_prob=True,
    )


HF_NAMES = hf_names({**HF_ATTENTION_ROLES, "router": "block_sparse_moe.gate.weight"})
GGUF_NAMES = gguf_names({**GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES})
_HF_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_experts = swiglu_experts_builder(
    lambda l, e, r: f"model.layers.{l}.block_sparse_moe.experts.{e}.{_HF_EXPERT[r]}.weight")


class MixtralModel(MoeDecoderModel):
    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        window = getattr(config, "sliding_window", None)
        return Arch(experts=_experts, windows=(window,) * config.num_layers if window else (), unpermute_qk=True)
