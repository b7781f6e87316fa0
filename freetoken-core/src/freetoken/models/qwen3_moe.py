"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``, GGUF architecture ``qwen3moe``).

GQA attention with per-head q/k RMSNorm and NeoX RoPE, RMSNorm pre-norms, top-k
softmax routing (``norm_topk_prob``) over SwiGLU experts, tied or untied
embeddings; dense-MLP layers where ``mlp_only_layers``/``decoder_sparse_step`` say.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch

from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor, TensorSource
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.models.config import ModelConfig, gguf_config_fields, hf_config_fields
from freetoken.backends.contract import WeightPolicy
from freetoken.models.dense_ops import dense_ops_for
from freetoken.models.layers import FusedLinears, Rotary
from freetoken.models.moe_layer import ExpertWeights, MoELayer, stack_experts

logger = logging.getLogger(__name__)

ARCHITECTURE = "qwen3_moe"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3moe",)


# ------------------------------------------------------------------------ configs


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise CheckpointError("Qwen3-MoE checkpoints with attention_bias=true are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"Qwen3-MoE with hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise CheckpointError("Qwen3-MoE with use_sliding_window=true is not supported (full attention only)")
    qc = cfg.get("quantization_config")
    if qc:
        method = qc.get("quant_method")
        if method != "fp8":
            raise CheckpointError(
                f"quantization method {method!r} is not supported (HF checkpoints: BF16/FP16/FP32 or FP8 with "
                "128x128 block scales; use a GGUF file for other quantizations)")
        block = qc.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            raise CheckpointError(f"FP8 weight_block_size {block} is not supported (128x128 only)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise CheckpointError(f"RoPE scaling {rope_type!r} is not supported yet (default RoPE only)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    eos: list[int] = []
    for src in (generation_config or {}, cfg):
        v = src.get("eos_token_id")
        if v is None:
            continue
        for e in v if isinstance(v, list) else [v]:
            if int(e) not in eos:
                eos.append(int(e))
    return ModelConfig(
        architecture=ARCHITECTURE,
        **hf_config_fields(cfg, tuple(eos)),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
        top_k=int(cfg["num_experts_per_tok"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rope_theta=float(theta),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> ModelConfig:
    from freetoken.loading.gguf import gguf_int

    a = meta.get("general.architecture", "qwen3moe")
    return ModelConfig(
        architecture=ARCHITECTURE,
        **gguf_config_fields(meta, a, has_output),  # vocab_size -1 when absent: filled from token_embd
        intermediate_size=gguf_int(meta, f"{a}.feed_forward_length", 0),
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length"),
        num_experts=gguf_int(meta, f"{a}.expert_count"),
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        # llama.cpp always renormalises the top-k weights for qwen3moe.
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
    )


# ------------------------------------------------------------------ tensor names


@dataclasses.dataclass(frozen=True)
class Names:
    """Where each weight lives in one checkpoint format."""

    embed: str
    norm: str
    lm_head: str
    layer: Callable[[int, str], str]  # (layer, role) -> name
    expert: Optional[Callable[[int, int, str], str]]  # HF per-expert names, or None (stacked)


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
    "mlp_gate": "mlp.gate_proj.weight",
    "mlp_up": "mlp.up_proj.weight",
    "mlp_down": "mlp.down_proj.weight",
    "gate_up_exps": "mlp.experts.gate_up_proj",
    "down_exps": "mlp.experts.down_proj",
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
    "mlp_gate": "ffn_gate.weight",
    "mlp_up": "ffn_up.weight",
    "mlp_down": "ffn_down.weight",
    "gate_exps": "ffn_gate_exps.weight",
    "up_exps": "ffn_up_exps.weight",
    "down_exps": "ffn_down_exps.weight",
}

HF_NAMES = Names(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    layer=lambda i, r: f"model.layers.{i}.{_HF_ROLES[r]}",
    expert=lambda i, e, p: f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight",
)

GGUF_NAMES = Names(
    embed="token_embd.weight",
    norm="output_norm.weight",
    lm_head="output.weight",
    layer=lambda i, r: f"blk.{i}.{_GGUF_ROLES[r]}",
    expert=None,
)


# ------------------------------------------------------------------------ model


class _Layer:
    __slots__ = ("in_norm", "post_norm", "qkv", "o", "q_norm", "k_norm", "qk_norm", "moe", "mlp")


class Qwen3MoeModel:
    """The runnable model: weights placed by a :class:`WeightPolicy`, forward over a
    flat batch of tokens with paged KV."""

    def __init__(self, config: ModelConfig, source: TensorSource, names: Names, policy: WeightPolicy,
                 progress: Optional[Callable[[int], None]] = None) -> None:
        self.config = c = config
        self.device = policy.device
        self.dtype = policy.dtype
        self.scale = c.head_dim ** -0.5
        get = source.get
        self.embed = policy.embedding(get(names.embed))
        if c.vocab_size <= 0:
            c.vocab_size = self.embed.raw.shape[0]
        self.norm = policy.tensor(get(names.norm))
        if source.has(names.lm_head) and not c.tie_word_embeddings:
            self.lm_head = policy.linear(get(names.lm_head))
        else:
            self.lm_head = policy.linear(get(names.embed))
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.max_position_embeddings, self.device)
        self.ops = dense_ops_for(self.device)
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            L = _Layer()
            n = lambda role: get(names.layer(i, role))  # noqa: E731
            L.in_norm = policy.tensor(n("in_norm"))
            L.post_norm = policy.tensor(n("post_norm"))
            L.qkv = FusedLinears([n("q"), n("k"), n("v")], policy)
            L.o = policy.linear(n("o"))
            L.q_norm = policy.tensor(n("q_norm"))
            L.k_norm = policy.tensor(n("k_norm"))
            # q and k come out of one call: normalise and rotate them as one [T, Hq+Hkv, D] view
            L.qk_norm = None
            if len(L.qkv.groups[0][1]) >= 2:
                L.qk_norm = torch.cat([L.q_norm.expand(c.num_heads, c.head_dim),
                                       L.k_norm.expand(c.num_kv_heads, c.head_dim)]).contiguous()
            L.moe = None
            L.mlp = None
            if c.is_moe_layer(i):
                experts = self._experts(i, source, names)
                L.moe = MoELayer(i, policy.router(n("router")), experts, c.top_k, c.norm_topk_prob)
                L.moe.ops = self.ops
            else:
                L.mlp = tuple(policy.linear(n(r)) for r in ("mlp_gate", "mlp_up", "mlp_down"))
            self.layers.append(L)
            if progress is not None:
                progress(i)

    def _experts(self, i: int, source: TensorSource, names: Names) -> ExpertWeights:
        c = self.config
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        if names.expert is not None and source.has(names.expert(i, 0, "gate")):
            gate = stack_experts([source.get(names.expert(i, e, "gate")) for e in range(E)], f"layer{i}.gate")
            up = stack_experts([source.get(names.expert(i, e, "up")) for e in range(E)], f"layer{i}.up")
            down = stack_experts([source.get(names.expert(i, e, "down")) for e in range(E)], f"layer{i}.down")
        elif names.expert is not None and source.has(names.layer(i, "gate_up_exps")):
            # transformers>=5 fused layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            gu = source.get(names.layer(i, "gate_up_exps"))
            t = gu.raw_torch()
            gate = RawTensor(gu.name, (E, I, H), gu.fmt, t[:, :I].contiguous(), gu.source)
            up = RawTensor(gu.name, (E, I, H), gu.fmt, t[:, I:].contiguous(), gu.source)
            down = source.get(names.layer(i, "down_exps"))
        else:
            gate, up, down = (source.get(names.layer(i, r)) for r in ("gate_exps", "up_exps", "down_exps"))
        for t, shape in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{t.source}: {t.name} has shape {tuple(t.shape)}, expected {shape}")
        return ExpertWeights(gate, up, down, E, H, I)

    # ---------------------------------------------------------------- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's tokens."""
        c = self.config
        eps = c.rms_norm_eps
        ops = self.ops
        h = self.embed(input_ids)
        slots = meta.slot_mapping
        delta: Optional[torch.Tensor] = None  # what the previous block adds to h
        for L, (kc, vc) in zip(self.layers, kv_caches):
            h, (q, k, v) = L.qkv.add_norm_call(ops, h, delta, L.in_norm, eps)
            q = ops.qk_norm_rope_store(q, k, v, L.q_norm, L.k_norm, L.qk_norm, self.rotary, positions, kc, vc,
                                       slots, eps)  # fmt: skip
            o = L.o(paged_attention(q, kc, vc, meta, self.scale))
            if L.moe is not None:
                h, delta = L.moe.add_norm_forward(h, o, L.post_norm, eps)
            else:
                h, x = ops.add_rms_norm(h, o, L.post_norm, eps)
                g, u, d = L.mlp
                delta = d(torch.nn.functional.silu(g(x)) * u(x))
        return ops.add_rms_norm(h, delta, self.norm, eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------- accounting

    def bytes_per_token(self) -> dict[str, int]:
        """Weight bytes one decode token reads (batch 1): dense part and experts."""
        dense = self.lm_head.nbytes
        experts = 0
        for L in self.layers:
            dense += L.qkv.nbytes + L.o.nbytes
            if L.moe is not None:
                dense += L.moe.router.nbytes
                experts += self.config.top_k * L.moe.experts.bytes_per_expert
            else:
                dense += sum(p.nbytes for p in L.mlp)
        return {"dense": dense, "experts": experts}
