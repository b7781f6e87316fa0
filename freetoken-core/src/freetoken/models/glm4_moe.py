"""GLM-4.5 (HF ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6; GGUF architecture
``glm4moe``).

GQA attention with q/k/v biases (``attention_bias``), optional per-head q/k RMSNorm
(``use_qk_norm``, after the biases), NeoX RoPE on the first ``partial_rotary_factor`` of each
head (rotate-half within those dimensions, the rest passed through), RMSNorm pre-norms. The
first ``first_k_dense_replace`` layers have a dense SwiGLU MLP (``intermediate_size``); the
others route over SwiGLU experts (``moe_intermediate_size``) with sigmoid scores, the
``e_score_correction_bias`` for the choice only, grouped top-k (``n_group``,
``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``
(:mod:`freetoken.models.routing`), plus ``n_shared_experts`` shared experts as one ungated
SwiGLU of ``n_shared_experts * moe_intermediate_size``.

The checkpoints carry ``num_nextn_predict_layers`` next-token-prediction layers after the
last decoder layer (HF ``model.layers.{n}``, GGUF ``blk.{n}`` with ``block_count`` counting
them); they are not run: their tensors are skipped with one log line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import TensorSource
from freetoken.models.config import ModelConfig, check_hf_support, gguf_config_fields, hf_config_fields, hf_eos_ids
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, Names, swiglu_experts_builder
from freetoken.models.rope import default_rope_theta, hf_rope_parameters
from freetoken.models.routing import GroupedTopK, gguf_routing_fields
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, HF_ATTENTION_ROLES, HF_MLP_ROLES
from freetoken.models.tensor_names import gguf_names, hf_names, skip_nextn_layers

logger = logging.getLogger(__name__)

ARCHITECTURE = "glm4_moe"
HF_ARCHITECTURES = ("Glm4MoeForCausalLM",)
GGUF_ARCHITECTURES = ("glm4moe",)
#: the routing GLM-4.5 runs (DeepSeek-V3's name for it) and its scoring function
TOPK_METHODS = ("noaux_tc",)
SCORING_FUNCS = ("sigmoid",)
#: llama.cpp's ``expert_gating_func`` values (gguf.ExpertGatingFuncType)
GGUF_GATING_SIGMOID = 2


@dataclasses.dataclass
class Glm4MoeConfig(ModelConfig):
    rotary_dim: int = 0
    attention_bias: bool = False
    use_qk_norm: bool = False
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 0

    def shared_expert_intermediate(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def routing(self) -> GroupedTopK:
        return GroupedTopK(self.num_experts, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                           self.routed_scaling_factor)  # fmt: skip


def _finish(cfg: Glm4MoeConfig, where: str) -> Glm4MoeConfig:
    """Checks shared by both formats; the dense leading layers as ``mlp_only_layers``."""
    D = cfg.head_dim
    if not 0 < cfg.rotary_dim <= D or cfg.rotary_dim % 2:
        raise CheckpointError(f"{where}: rotary dimension {cfg.rotary_dim} (partial_rotary_factor) does not fit "
                              f"head_dim {D}")  # fmt: skip
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_layers:
        raise CheckpointError(f"{where}: first_k_dense_replace={cfg.first_k_dense_replace} is not in "
                              f"0..{cfg.num_layers}")  # fmt: skip
    if cfg.first_k_dense_replace and cfg.intermediate_size <= 0:
        raise CheckpointError(f"{where}: first_k_dense_replace={cfg.first_k_dense_replace} dense layers need "
                              "intermediate_size")  # fmt: skip
    if cfg.n_shared_experts < 0:
        raise CheckpointError(f"{where}: n_shared_experts={cfg.n_shared_experts} is negative")
    cfg.routing().check(where)
    cfg.mlp_only_layers = tuple(range(cfg.first_k_dense_replace))
    return cfg


# ------------------------------------------------------------------------ configs


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> Glm4MoeConfig:
    where = "GLM-4.5 config.json"
    check_hf_support(cfg, "GLM-4.5", attention_bias=False)
    method = cfg.get("topk_method")
    if method is not None and method not in TOPK_METHODS:
        raise CheckpointError(f"{where}: topk_method={method!r} is not supported ({', '.join(TOPK_METHODS)})")
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring not in SCORING_FUNCS:
        raise CheckpointError(f"{where}: scoring_func={scoring!r} is not supported ({', '.join(SCORING_FUNCS)})")
    fields = hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-5, max_positions=131072)
    rope = hf_rope_parameters(cfg)
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    return _finish(Glm4MoeConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0))),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        rope_theta=default_rope_theta(cfg, "GLM-4.5"),
        rotary_dim=int(fields["head_dim"] * factor),
        attention_bias=bool(cfg.get("attention_bias", False)),
        use_qk_norm=bool(cfg.get("use_qk_norm", False)),
        n_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
        n_group=int(cfg.get("n_group", 1) or 1),
        topk_group=int(cfg.get("topk_group", 1) or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 1)),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
    ), where)


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> Glm4MoeConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "glm4moe")
    where = f"GGUF {a}"
    gating = gguf_int(meta, f"{a}.expert_gating_func", GGUF_GATING_SIGMOID)
    if gating != GGUF_GATING_SIGMOID:
        raise CheckpointError(f"{where}: {a}.expert_gating_func={gating} is not supported "
                              f"({GGUF_GATING_SIGMOID}: sigmoid)")  # fmt: skip
    kind = meta.get(f"{a}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise CheckpointError(f"{where}: {a}.rope.scaling.type={kind!r} is not supported (none)")
    fields = gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-5, max_positions=131072)
    nextn = gguf_int(meta, f"{a}.nextn_predict_layers", 0)
    fields["num_layers"] -= nextn  # llama.cpp's block_count counts the next-token-prediction layers
    return _finish(Glm4MoeConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=gguf_int(meta, f"{a}.feed_forward_length", 0),
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length"),
        num_experts=gguf_int(meta, f"{a}.expert_count"),
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
        rotary_dim=gguf_int(meta, f"{a}.rope.dimension_count", fields["head_dim"] // 2),
        attention_bias=True,  # decided per file by its tensors (Glm4MoeModel)
        use_qk_norm=False,
        **gguf_routing_fields(meta, a, shared_default=1, dense_default=1),
        num_nextn_predict_layers=nextn,
    ), where)


# ------------------------------------------------------------------ tensor names

_HF_ROLES = {
    **HF_ATTENTION_ROLES, **HF_MLP_ROLES,
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "expert_bias": "mlp.gate.e_score_correction_bias",
    "shexp_gate": "mlp.shared_experts.gate_proj.weight", "shexp_up": "mlp.shared_experts.up_proj.weight",
    "shexp_down": "mlp.shared_experts.down_proj.weight",
}  # fmt: skip
_GGUF_ROLES = {
    **GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES,
    "post_norm": "post_attention_norm.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "expert_bias": "exp_probs_b.bias",
    "shexp_gate": "ffn_gate_shexp.weight", "shexp_up": "ffn_up_shexp.weight", "shexp_down": "ffn_down_shexp.weight",
}  # fmt: skip

HF_NAMES = hf_names(_HF_ROLES)
GGUF_NAMES = gguf_names(_GGUF_ROLES)
_experts = swiglu_experts_builder(lambda l, e, r: f"model.layers.{l}.mlp.experts.{e}.{r}_proj.weight")

# ------------------------------------------------------------------------ model


class Glm4MoeModel(MoeDecoderModel):
    def __init__(self, config: ModelConfig, source: TensorSource, names: Names, *args: Any, **kw: Any) -> None:
        cfg: Glm4MoeConfig = config  # type: ignore[assignment]
        if names.fmt == "gguf":  # the file says by its tensors whether attention has biases / q-k norms
            cfg.attention_bias = source.has(names.layer(0, "q_bias")) if cfg.num_layers else False
            cfg.use_qk_norm = source.has(names.layer(0, "q_norm")) if cfg.num_layers else False
        self.skipped_tensors = skip_nextn_layers(source, names, config)
        super().__init__(config, source, names, *args, **kw)

    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        cfg: Glm4MoeConfig = config  # type: ignore[assignment]
        return Arch(experts=_experts, qk_norm="head" if cfg.use_qk_norm else "none", qkv_bias=cfg.attention_bias,
                    rotary_dim=cfg.rotary_dim, routing=cfg.routing(), shared_experts=cfg.n_shared_experts > 0)
