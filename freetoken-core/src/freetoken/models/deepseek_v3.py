"""The DeepSeek family: HF ``DeepseekV3ForCausalLM`` (DeepSeek-V3, V3.1, R1, Kimi-K2) and
``DeepseekV2ForCausalLM`` (DeepSeek-V2, V2-Lite, V2.5); GGUF architecture ``deepseek2``
(llama.cpp writes every one of them so).

Per layer: RMSNorm -> multi-head latent attention (:mod:`freetoken.models.mla`: query LoRA
or a plain query projection, the compressed KV latent cached per token, decoupled RoPE on
``qk_rope_head_dim`` dimensions, decode with the up-projections absorbed) -> RMSNorm ->
a dense SwiGLU MLP (``intermediate_size``) on the first ``first_k_dense_replace`` layers and
where ``moe_layer_freq`` skips, else routed SwiGLU experts (``moe_intermediate_size``) plus
``n_shared_experts`` shared experts as one ungated SwiGLU.

Routing (:mod:`freetoken.models.routing`): V3 (``topk_method`` "noaux_tc",
``scoring_func`` "sigmoid"): sigmoid scores, ``e_score_correction_bias`` for the choice
only, groups ranked by the sum of their two best corrected scores (``n_group``,
``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor``. V2 (``scoring_func``
"softmax"): ``topk_method`` "greedy" (no groups) or "group_limited_greedy" (groups ranked
by their best score); weights renormalised when ``norm_topk_prob`` (llama.cpp's rule; the
published V2 checkpoints do not), then scaled.

RoPE: YaRN (``rope_scaling`` type "yarn") scales the rotary tables by the attention factor
(``mscale / mscale_all_dim`` through YaRN's ``0.1 * m * ln(factor) + 1``, or given), and
the softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` times
``(0.1 * mscale_all_dim * ln(factor) + 1)^2``. GGUF files carry ``0.1 * mscale_all_dim``
as ``rope.scaling.yarn_log_multiplier`` and no ``mscale``: llama.cpp leaves their rotary
tables unscaled (``mscale == mscale_all_dim``, as every published checkpoint has).

The checkpoints' next-token-prediction layers (``num_nextn_predict_layers``: HF
``model.layers.{n}`` and on) are not run: their tensors are skipped with one log line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional

import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import TensorSource
from freetoken.models.attention import AttentionMetadata
from freetoken.models.config import KVLayout, ModelConfig, check_hf_support, gguf_config_fields, hf_config_fields
from freetoken.models.config import hf_eos_ids
from freetoken.models.decoder_base import DecoderModelBase
from freetoken.models.mla import MlaAttention, MlaShape
from freetoken.models.moe_decoder import Names, swiglu_experts_builder
from freetoken.models.rope import RopeScaling, hf_rope_parameters, make_rotary
from freetoken.models.routing import GroupedTopK, gguf_routing_fields
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, HF_ATTENTION_ROLES, HF_MLP_ROLES
from freetoken.models.tensor_names import gguf_names, hf_names, skip_nextn_layers

logger = logging.getLogger(__name__)

ARCHITECTURE = "deepseek_v3"
HF_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
GGUF_ARCHITECTURES = ("deepseek2",)
#: (topk_method, scoring_func) pairs and the routing they are
ROUTINGS = {("noaux_tc", "sigmoid"): "sigmoid", ("greedy", "softmax"): "softmax",
            ("group_limited_greedy", "softmax"): "softmax"}  # fmt: skip
#: llama.cpp's ``expert_gating_func`` values (gguf.ExpertGatingFuncType)
GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * m * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclasses.dataclass
class DeepseekConfig(ModelConfig):
    q_lora_rank: int = 0  # 0: a plain query projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    #: the checkpoint's q_pe/k_pe rows rotate interleaved pairs (reordered at load)
    rope_interleave: bool = True
    rope_scaling: RopeScaling = RopeScaling()
    #: the softmax scale's YaRN factor (the scale is multiplied by its square)
    softmax_mscale: float = 1.0
    scoring: str = "sigmoid"
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0

    def mla_shape(self) -> MlaShape:
        return MlaShape(self.num_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                        self.qk_rope_head_dim, self.v_head_dim)  # fmt: skip

    def kv_layout(self) -> KVLayout:
        return self.mla_shape().kv_layout()

    def attention_weights(self) -> int:
        H, s = self.hidden_size, self.mla_shape()
        q = H * s.q_lora_rank + s.q_lora_rank * s.heads * s.qk_head_dim if s.q_lora_rank else H * s.heads * s.qk_head_dim
        return q + H * s.latent + s.kv_lora_rank * s.heads * (s.nope + s.v_dim) + s.heads * s.v_dim * H

    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * self.softmax_mscale**2

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % max(1, self.moe_layer_freq) == 0

    def shared_expert_intermediate(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def routing(self) -> GroupedTopK:
        return GroupedTopK(self.num_experts, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                           self.routed_scaling_factor, self.scoring)  # fmt: skip


def _finish(cfg: DeepseekConfig, where: str) -> DeepseekConfig:
    """Checks shared by both formats; the dense layers as ``mlp_only_layers``."""
    cfg.mla_shape().check(where)
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_layers:
        raise CheckpointError(f"{where}: first_k_dense_replace={cfg.first_k_dense_replace} is not in "
                              f"0..{cfg.num_layers}")  # fmt: skip
    if cfg.moe_layer_freq < 1:
        raise CheckpointError(f"{where}: moe_layer_freq={cfg.moe_layer_freq} must be >= 1")
    cfg.mlp_only_layers = tuple(i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i))
    if cfg.mlp_only_layers and cfg.intermediate_size <= 0:
        raise CheckpointError(f"{where}: dense layers {list(cfg.mlp_only_layers)} need intermediate_size")
    if cfg.n_shared_experts < 0:
        raise CheckpointError(f"{where}: n_shared_experts={cfg.n_shared_experts} is negative")
    if cfg.num_experts:
        cfg.routing().check(where)
    cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.num_kv_heads = cfg.num_heads
    return cfg


# ------------------------------------------------------------------------ configs


def _hf_rope(cfg: dict[str, Any], where: str) -> tuple[float, RopeScaling, float]:
    """(rope_theta, the rotary tables' scaling, the softmax mscale) of an HF config."""
    rope = hf_rope_parameters(cfg)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, RopeScaling(), 1.0
    if kind != "yarn":
        raise CheckpointError(f"{where}: rope_scaling type={kind!r} is not supported (default, yarn)")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else int(cfg["max_position_embeddings"]) / original
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None and mscale and mscale_all:
        attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    elif attention is None:
        attention = yarn_mscale(factor)
    scaling = RopeScaling(kind="yarn", factor=factor, original_max_positions=original,
                          beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                          truncate=bool(rope.get("truncate", True)), attention_factor=float(attention))  # fmt: skip
    return theta, scaling, yarn_mscale(factor, float(mscale_all)) if mscale_all else 1.0


def _required(cfg: dict[str, Any], key: str, where: str) -> int:
    if cfg.get(key) is None:
        raise CheckpointError(f"{where}: {key} is missing (multi-head latent attention needs it)")
    return int(cfg[key])


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> DeepseekConfig:
    v2 = "DeepseekV2ForCausalLM" in (cfg.get("architectures") or [])
    family = "DeepSeek-V2" if v2 else "DeepSeek-V3"
    where = f"{family} config.json"
    check_hf_support(cfg, family)
    method = cfg.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    scoring = cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    if method not in {m for m, _ in ROUTINGS}:
        raise CheckpointError(f"{where}: topk_method={method!r} is not supported "
                              f"({', '.join(sorted({m for m, _ in ROUTINGS}))})")  # fmt: skip
    if (method, scoring) not in ROUTINGS:
        raise CheckpointError(f"{where}: scoring_func={scoring!r} with topk_method={method!r} is not supported "
                              f"({', '.join(f'{m}/{s}' for m, s in ROUTINGS)})")  # fmt: skip
    grouped = method != "greedy"
    fields = hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-6, max_positions=4096)
    theta, scaling, softmax_mscale = _hf_rope(cfg, where)
    return _finish(DeepseekConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        num_experts=int(cfg.get("n_routed_experts") or 0),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", not v2)),
        rope_theta=theta,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=_required(cfg, "kv_lora_rank", where),
        qk_nope_head_dim=_required(cfg, "qk_nope_head_dim", where),
        qk_rope_head_dim=_required(cfg, "qk_rope_head_dim", where),
        v_head_dim=_required(cfg, "v_head_dim", where),
        rope_interleave=True if v2 else bool(cfg.get("rope_interleave", True)),
        rope_scaling=scaling,
        softmax_mscale=softmax_mscale,
        scoring=ROUTINGS[(method, scoring)],
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0) or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq", 1) or 1),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
    ), where)


def _gguf_rope(meta: dict[str, Any], a: str, where: str) -> tuple[RopeScaling, float]:
    from freetoken.loading.gguf import gguf_float, gguf_int

    kind = meta.get(f"{a}.rope.scaling.type", "none") or "none"
    if kind == "none":
        return RopeScaling(), 1.0
    if kind != "yarn":
        raise CheckpointError(f"{where}: {a}.rope.scaling.type={kind!r} is not supported (none, yarn)")
    factor = gguf_float(meta, f"{a}.rope.scaling.factor")
    log_mul = gguf_float(meta, f"{a}.rope.scaling.yarn_log_multiplier", 0.0)
    scaling = RopeScaling(kind="yarn", factor=factor,
                          original_max_positions=gguf_int(meta, f"{a}.rope.scaling.original_context_length"),
                          beta_fast=gguf_float(meta, f"{a}.rope.scaling.yarn_beta_fast", 32.0),
                          beta_slow=gguf_float(meta, f"{a}.rope.scaling.yarn_beta_slow", 1.0),
                          truncate=True, attention_factor=1.0)  # fmt: skip
    return scaling, 1.0 + log_mul * math.log(factor) if factor > 1 else 1.0


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> DeepseekConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "deepseek2")
    where = f"GGUF {a}"
    gating = gguf_int(meta, f"{a}.expert_gating_func", 1)  # llama.cpp's default for files without it: softmax
    if gating not in GGUF_GATING:
        raise CheckpointError(f"{where}: {a}.expert_gating_func={gating} is not supported "
                              f"({', '.join(f'{k}: {v}' for k, v in GGUF_GATING.items())})")  # fmt: skip
    fields = gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-6, max_positions=4096)
    rope = gguf_int(meta, f"{a}.rope.dimension_count")
    if f"{a}.attention.key_length_mla" in meta:  # newer files: key_length/value_length are the latent's
        qk, v = gguf_int(meta, f"{a}.attention.key_length_mla"), gguf_int(meta, f"{a}.attention.value_length_mla")
    else:
        qk, v = gguf_int(meta, f"{a}.attention.key_length"), gguf_int(meta, f"{a}.attention.value_length")
    nextn = gguf_int(meta, f"{a}.nextn_predict_layers", 0)
    fields["num_layers"] -= nextn
    scaling, softmax_mscale = _gguf_rope(meta, a, where)
    return _finish(DeepseekConfig(
        architecture=ARCHITECTURE,
        **fields,
        intermediate_size=gguf_int(meta, f"{a}.feed_forward_length", 0),
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length", 0),
        num_experts=gguf_int(meta, f"{a}.expert_count", 0),
        top_k=gguf_int(meta, f"{a}.expert_used_count", 0),
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", False)),
        q_lora_rank=gguf_int(meta, f"{a}.attention.q_lora_rank", 0),
        kv_lora_rank=gguf_int(meta, f"{a}.attention.kv_lora_rank"),
        qk_nope_head_dim=qk - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=True,  # llama.cpp rotates interleaved pairs and its converter keeps the rows as stored
        rope_scaling=scaling,
        softmax_mscale=softmax_mscale,
        scoring=GGUF_GATING[gating],
        **gguf_routing_fields(meta, a, shared_default=0, dense_default=0),
        num_nextn_predict_layers=nextn,
    ), where)


# ------------------------------------------------------------------ tensor names

_HF_ROLES = {
    **HF_ATTENTION_ROLES, **HF_MLP_ROLES,
    "q_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b": "self_attn.kv_b_proj.weight",
    "expert_bias": "mlp.gate.e_score_correction_bias",
    "shexp_gate": "mlp.shared_experts.gate_proj.weight", "shexp_up": "mlp.shared_experts.up_proj.weight",
    "shexp_down": "mlp.shared_experts.down_proj.weight",
}  # fmt: skip
_GGUF_ROLES = {
    **GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES,
    "q_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "q_b": "attn_q_b.weight",
    "kv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "kv_b": "attn_kv_b.weight",
    "k_b": "attn_k_b.weight", "v_b": "attn_v_b.weight",
    "expert_bias": "exp_probs_b.bias",
    "shexp_gate": "ffn_gate_shexp.weight", "shexp_up": "ffn_up_shexp.weight", "shexp_down": "ffn_down_shexp.weight",
}  # fmt: skip

HF_NAMES = hf_names(_HF_ROLES)
GGUF_NAMES = gguf_names(_GGUF_ROLES)
_experts = swiglu_experts_builder(lambda l, e, r: f"model.layers.{l}.mlp.experts.{e}.{r}_proj.weight")


# ------------------------------------------------------------------------ model


class _Layer:
    __slots__ = ("in_norm", "post_norm", "attn", "moe", "mlp")


class DeepseekV3Model(DecoderModelBase):
    """The runnable model: weights placed by a :class:`WeightPolicy`, forward over a flat
    batch of tokens with the paged latent cache."""

    def __init__(self, config: ModelConfig, source: TensorSource, names: Names, policy: WeightPolicy,
                 progress: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        c: DeepseekConfig = config  # type: ignore[assignment]
        self.skipped_tensors = skip_nextn_layers(source, names, config)
        self._load_ends(config, source, names, policy)
        self.scale = c.softmax_scale()
        self.rotary = make_rotary(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                                  self.device)  # fmt: skip
        shape = c.mla_shape()
        for i in range(c.num_layers):
            L = _Layer()
            n = lambda role, i=i: source.get(names.layer(i, role))  # noqa: E731
            L.in_norm = policy.tensor(n("in_norm"))
            L.post_norm = policy.tensor(n("post_norm"))
            L.attn = MlaAttention(shape, n, lambda role, i=i: _has(source, names, i, role), policy, c.rope_interleave)
            self._load_ffn(L, i, n, policy, lambda i=i: _experts(i, source, names, c), routing=c.routing(),
                           shared=c.n_shared_experts > 0)  # fmt: skip
            self.layers.append(L)
            if progress is not None:
                progress(i)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """Final-normed hidden states ``[T, hidden]`` of the step's tokens."""
        c, ops = self.config, self.ops
        eps = c.rms_norm_eps
        h = self.embed(input_ids)
        cos, sin = self.rotary.tables(positions, h.dtype)
        delta: Optional[torch.Tensor] = None  # what the previous block adds to h
        for L, (latents, _) in zip(self.layers, kv_caches):
            h, (qa, kva) = L.attn.proj_a.add_norm_call(ops, h, delta, L.in_norm, eps)
            o = L.attn(qa, kva, self.rotary, cos, sin, meta, latents, self.scale, eps)
            h, delta = self._feed_forward(L, h, o, eps)
        return ops.add_rms_norm(h, delta, self.norm, eps)[1]

    def _mixer_bytes(self, L: Any) -> int:
        return int(L.attn.nbytes)


def _has(source: TensorSource, names: Names, i: int, role: str) -> bool:
    try:
        return source.has(names.layer(i, role))
    except KeyError:  # a role this format has no tensor for
        return False
