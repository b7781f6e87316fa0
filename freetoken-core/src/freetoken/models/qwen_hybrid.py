"""The Qwen3-Next / Qwen3.5-MoE hybrid decoder (families ``qwen3_next`` and ``qwen3_5_moe``).

Layers are either Gated DeltaNet linear attention (:mod:`freetoken.models.gated_deltanet`,
state per request) or gated full attention over the paged KV cache: GQA with per-head q/k
RMSNorm, NeoX RoPE on a leading fraction of each head (``partial_rotary_factor``), and an
output gate ``o * sigmoid(gate)`` whose weights come out of ``q_proj`` beside each head's
query. Every RMSNorm outside the DeltaNet is zero-centred in HF checkpoints (the norm
multiplies by ``1 + w``; GGUF files store ``1 + w``). The MLP is routed experts (softmax
top-k, renormalised when ``norm_topk_prob``) plus a shared SwiGLU expert scaled by
``sigmoid(x . w_gate)``; Qwen3-Next may have dense-MLP layers.

The two families differ in how the checkpoints store the DeltaNet projections
(:class:`HybridNames` and the loaders in this module): Qwen3.5 stores ``[q|k|v]``, ``z``,
``b``, ``a`` separately; Qwen3-Next HF checkpoints interleave ``[q, k, v, z]`` and ``[b, a]``
per key head (reordered here at load); llama.cpp's Qwen3.5 GGUF files store the value heads
tiled over the key heads (head ``j`` uses key head ``j mod key_heads``) instead of grouped.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor, TensorSource
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.models.config import ModelConfig, RecurrentStateShape
from freetoken.models.decoder_base import DecoderModelBase
from freetoken.models.gated_deltanet import DeltaNetShape, GatedDeltaNet
from freetoken.models.hybrid_weights import PartialRotary, offset_norm, rotary_permutation, take_rows
from freetoken.models.layers import FusedLinears
from freetoken.models.moe_block import swiglu_experts
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, GGUF_MLP_ROLES, HF_ATTENTION_ROLES, HF_MLP_ROLES
from freetoken.models.moe_layer import ExpertWeights

logger = logging.getLogger(__name__)

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclasses.dataclass
class HybridConfig(ModelConfig):
    """:class:`ModelConfig` plus the hybrid families' own shapes."""

    layer_types: tuple[str, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 4
    rotary_dim: int = 0
    shared_expert_intermediate_size: int = 0
    #: value heads tiled over the key heads (llama.cpp's Qwen3.5 GGUF layout) instead of grouped
    value_heads_tiled: bool = False

    def deltanet_shape(self) -> DeltaNetShape:
        return DeltaNetShape(self.linear_key_heads, self.linear_value_heads, self.linear_key_dim,
                             self.linear_value_dim, self.conv_kernel, self.value_heads_tiled)  # fmt: skip


def finish_config(cfg: HybridConfig, where: str) -> HybridConfig:
    """Check the layer pattern and shapes; fill ``kv_layers`` and ``recurrent``."""
    if len(cfg.layer_types) != cfg.num_layers:
        raise CheckpointError(f"{where}: layer_types has {len(cfg.layer_types)} entries for {cfg.num_layers} layers")
    bad = sorted({t for t in cfg.layer_types if t not in (LINEAR, FULL)})
    if bad:
        raise CheckpointError(f"{where}: layer types {bad} are not supported (supported: {LINEAR}, {FULL})")
    if cfg.linear_value_heads % max(1, cfg.linear_key_heads):
        raise CheckpointError(f"{where}: {cfg.linear_value_heads} linear-attention value heads are not a multiple "
                              f"of its {cfg.linear_key_heads} key heads")  # fmt: skip
    if not 0 < cfg.rotary_dim <= cfg.head_dim or cfg.rotary_dim % 2:
        raise CheckpointError(f"{where}: rotary dimension {cfg.rotary_dim} does not fit head_dim {cfg.head_dim}")
    cfg.kv_layers = tuple(i for i, t in enumerate(cfg.layer_types) if t == FULL)
    linear = tuple(i for i, t in enumerate(cfg.layer_types) if t == LINEAR)
    s = cfg.deltanet_shape()
    cfg.recurrent = RecurrentStateShape(linear, s.conv_state, s.ssm_state) if linear else None
    return cfg


# ------------------------------------------------------------------ tensor names

_HF_ROLES = {
    **HF_ATTENTION_ROLES, **HF_MLP_ROLES,
    "qkv": "linear_attn.in_proj_qkv.weight", "z": "linear_attn.in_proj_z.weight",
    "b": "linear_attn.in_proj_b.weight", "a": "linear_attn.in_proj_a.weight",
    "qkvz": "linear_attn.in_proj_qkvz.weight", "ba": "linear_attn.in_proj_ba.weight",
    "conv": "linear_attn.conv1d.weight", "A_log": "linear_attn.A_log", "dt_bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm.weight", "ssm_out": "linear_attn.out_proj.weight",
    "shexp_gate": "mlp.shared_expert.gate_proj.weight", "shexp_up": "mlp.shared_expert.up_proj.weight",
    "shexp_down": "mlp.shared_expert.down_proj.weight", "shexp_router": "mlp.shared_expert_gate.weight",
}  # fmt: skip

_GGUF_ROLES = {
    **GGUF_ATTENTION_ROLES, **GGUF_MLP_ROLES,
    "post_norm": "post_attention_norm.weight",
    "qkv": "attn_qkv.weight", "z": "attn_gate.weight", "b": "ssm_beta.weight", "a": "ssm_alpha.weight",
    "ba": "ssm_ba.weight", "conv": "ssm_conv1d.weight", "A": "ssm_a", "dt_bias": "ssm_dt.bias",
    "ssm_norm": "ssm_norm.weight", "ssm_out": "ssm_out.weight",
    "shexp_gate": "ffn_gate_shexp.weight", "shexp_up": "ffn_up_shexp.weight", "shexp_down": "ffn_down_shexp.weight",
    "shexp_router": "ffn_gate_inp_shexp.weight", "gate_up_exps": "ffn_gate_up_exps.weight",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HybridNames:
    """Where each weight lives in one checkpoint format (``gguf`` or ``hf``; HF names under
    ``prefix``, ``model.`` for the text-only classes and ``model.language_model.`` for the
    multimodal checkpoints Qwen3.5 ships)."""

    gguf: bool
    prefix: str = "model."

    @property
    def embed(self) -> str:
        return "token_embd.weight" if self.gguf else f"{self.prefix}embed_tokens.weight"

    @property
    def norm(self) -> str:
        return "output_norm.weight" if self.gguf else f"{self.prefix}norm.weight"

    @property
    def lm_head(self) -> str:
        return "output.weight" if self.gguf else "lm_head.weight"

    def layer(self, i: int, role: str) -> str:
        if self.gguf:
            return f"blk.{i}.{_GGUF_ROLES[role]}"
        return f"{self.prefix}layers.{i}.{_HF_ROLES[role]}"

    def expert(self, i: int, e: int, part: str) -> str:
        return f"{self.prefix}layers.{i}.mlp.experts.{e}.{part}_proj.weight"

    def for_source(self, source: TensorSource) -> "HybridNames":
        if self.gguf or source.has(self.embed):
            return self
        for prefix in ("model.language_model.", "model.", ""):
            alt = HybridNames(False, prefix)
            if source.has(alt.embed):
                return alt
        raise CheckpointError(f"no token embedding found (looked for {self.embed} and model.language_model.*)")


HF_NAMES = HybridNames(gguf=False)
GGUF_NAMES = HybridNames(gguf=True)


# ------------------------------------------------------------------------ model


class _Layer:
    __slots__ = ("kind", "in_norm", "post_norm", "linear", "qkvg", "o", "q_norm", "k_norm", "qk_norm", "kv_index",
                 "moe", "mlp")  # fmt: skip


class QwenHybridModel(DecoderModelBase):
    """The runnable hybrid model: weights placed by a :class:`WeightPolicy`, forward over a
    flat batch of tokens with paged KV (full-attention layers) and per-request recurrent
    state (linear-attention layers, :meth:`attach_recurrent_state`)."""

    #: how the HF checkpoints of the family store the DeltaNet input projections
    hf_fused_qkvz = False

    def __init__(self, config: HybridConfig, source: TensorSource, names: HybridNames, policy: WeightPolicy,
                 progress: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        names = names.for_source(source)
        self.names = names
        self._norm = (lambda raw: policy.tensor(raw)) if names.gguf else (lambda raw: policy.tensor(offset_norm(raw)))
        self._load_ends(config, source, names, policy, self._norm)
        c = config
        get = source.get
        self.rotary = PartialRotary(c.head_dim, c.rotary_dim, c.rope_theta, c.max_position_embeddings, self.device)
        self.rope_order = rotary_permutation(c.head_dim, c.rotary_dim)
        self.layers: list[_Layer] = []
        kv_index = {layer: j for j, layer in enumerate(c.kv_layers or ())}
        for i in range(c.num_layers):
            L = _Layer()
            n = lambda role: get(names.layer(i, role))  # noqa: E731
            L.kind = c.layer_types[i]
            L.in_norm = self._norm(n("in_norm"))
            L.post_norm = self._norm(n("post_norm"))
            L.linear = L.qkvg = L.o = L.q_norm = L.k_norm = L.qk_norm = None
            L.kv_index = -1
            if L.kind == LINEAR:
                L.linear = self._deltanet(i, source, names, policy)
                L.linear.ops = self.ops
            else:
                self._attention(L, i, source, names, policy)
                L.kv_index = kv_index[i]
            if (names.gguf and c.is_moe_layer(i) and not source.has(names.layer(i, "router"))
                    and source.has(names.layer(i, "mlp_gate"))):
                # GGUF metadata has no mlp_only_layers: a layer with a dense MLP says so by its tensors
                c.mlp_only_layers = tuple(sorted({*c.mlp_only_layers, i}))
            self._load_ffn(L, i, n, policy, lambda: (self._experts(i, source, names), None),
                           shared=c.shared_expert_intermediate_size > 0)  # fmt: skip
            self.layers.append(L)
            if progress is not None:
                progress(i)

    # ------------------------------------------------------------- loading

    def _attention(self, L: _Layer, i: int, source: TensorSource, names: HybridNames, policy: WeightPolicy) -> None:
        c = self.config
        D, Hq, Hkv = c.head_dim, c.num_heads, c.num_kv_heads
        get = lambda role: source.get(names.layer(i, role))  # noqa: E731
        qg = get("q")
        if tuple(qg.shape) != (2 * Hq * D, c.hidden_size):
            raise CheckpointError(f"{qg.source}: {qg.name} has shape {tuple(qg.shape)}, expected "
                                  f"{(2 * Hq * D, c.hidden_size)} (query and output gate per head)")  # fmt: skip
        order = self.rope_order
        heads = torch.arange(Hq).view(Hq, 1) * 2 * D
        q_rows = (heads + order.view(1, D)).reshape(-1)  # each head's query, in rotary order
        g_rows = (heads + D + torch.arange(D).view(1, D)).reshape(-1)
        k_rows = (torch.arange(Hkv).view(Hkv, 1) * D + order.view(1, D)).reshape(-1)
        q = take_rows(qg, q_rows, qg.name + ".query")
        gate = take_rows(qg, g_rows, qg.name + ".gate")
        k_raw = get("k")
        k = take_rows(k_raw, k_rows, k_raw.name)
        L.qkvg = FusedLinears([q, k, get("v"), gate], policy)
        L.o = policy.linear(get("o"))
        qn, kn = get("q_norm"), get("k_norm")
        if not names.gguf:
            qn, kn = offset_norm(qn), offset_norm(kn)
        L.q_norm = policy.tensor(qn)[order]
        L.k_norm = policy.tensor(kn)[order]
        L.qk_norm = None
        if len(L.qkvg.groups[0][1]) >= 2:
            L.qk_norm = torch.cat([L.q_norm.expand(Hq, D), L.k_norm.expand(Hkv, D)]).contiguous()

    def _deltanet(self, i: int, source: TensorSource, names: HybridNames, policy: WeightPolicy) -> GatedDeltaNet:
        c = self.config
        s = c.deltanet_shape()
        get = lambda role: source.get(names.layer(i, role))  # noqa: E731
        if not names.gguf and self.hf_fused_qkvz:
            parts = _split_qkvz(get("qkvz"), get("ba"), s)
        elif names.gguf and source.has(names.layer(i, "ba")):
            qkv, z = get("qkv"), get("z")
            b, a = _split_ba(get("ba"), s)
            parts = [qkv, z, b, a]
        else:
            parts = [get("qkv"), get("z"), get("b"), get("a")]
        expect = [s.conv_channels, s.value_heads * s.value_dim, s.value_heads, s.value_heads]
        for p, rows in zip(parts, expect):
            if tuple(p.shape) != (rows, c.hidden_size):
                raise CheckpointError(f"{p.source}: {p.name} has shape {tuple(p.shape)}, expected {(rows, c.hidden_size)}")
        proj = FusedLinears(parts, policy)
        conv = get("conv").to_float(torch.float32).reshape(s.conv_channels, s.conv_kernel)
        if names.gguf:
            A = get("A").to_float(torch.float32).reshape(-1)
        else:
            A = -get("A_log").to_float(torch.float32).reshape(-1).exp()
        dt_bias = get("dt_bias").to_float(torch.float32).reshape(-1)
        norm = policy.tensor(get("ssm_norm")).reshape(-1)
        out = policy.linear(get("ssm_out"))
        return GatedDeltaNet(i, s, proj, conv.to(self.device, self.dtype), A.to(self.device),
                             dt_bias.to(self.device, self.dtype), norm, out, c.rms_norm_eps)  # fmt: skip

    def _experts(self, i: int, source: TensorSource, names: HybridNames) -> ExpertWeights:
        layer = lambda l, r: names.layer(l, f"{r}_exps")  # noqa: E731
        return swiglu_experts(i, source, self.config, per_expert=None if names.gguf else names.expert, fused=layer,
                              stacked=layer if names.gguf else None)  # fmt: skip

    def attach_recurrent_state(self, pool: Any) -> None:
        """Give every linear-attention layer the engine's recurrent-state pool."""
        for L in self.layers:
            if L.linear is not None:
                L.linear.pool = pool

    # ---------------------------------------------------------------- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """Final-normed hidden states ``[T, hidden]`` of the step's tokens."""
        c = self.config
        eps = c.rms_norm_eps
        ops = self.ops
        h = self.embed(input_ids)
        delta: Optional[torch.Tensor] = None
        for L in self.layers:
            h, x = ops.add_rms_norm(h, delta, L.in_norm, eps)
            if L.linear is not None:
                mixed = L.linear(x, meta)
            else:
                kc, vc = kv_caches[L.kv_index]
                q, k, v, gate = L.qkvg(x)
                q = ops.qk_norm_rope_store(q, k, v, L.q_norm, L.k_norm, L.qk_norm, self.rotary, positions, kc, vc,
                                           meta.slot_mapping, eps)  # fmt: skip
                attn = paged_attention(q, kc, vc, meta, self.scale)
                mixed = L.o(attn * torch.sigmoid(gate))
            h, x = ops.add_rms_norm(h, mixed, L.post_norm, eps)
            delta = L.mlp(x) if L.moe is None else L.moe(x)  # routed (and shared) experts: moe_block
        return ops.add_rms_norm(h, delta, self.norm, eps)[1]

    # ------------------------------------------------------------- accounting

    def _mixer_bytes(self, L: _Layer) -> int:
        return L.linear.nbytes if L.linear is not None else L.qkvg.nbytes + L.o.nbytes


def _split_qkvz(qkvz: RawTensor, ba: RawTensor, s: DeltaNetShape) -> list[RawTensor]:
    """Qwen3-Next HF projections, per key head ``[q, k, v, z]`` and ``[b, a]``, as
    ``[q all heads | k | v]``, ``z``, ``b``, ``a`` (value heads grouped by key head)."""
    hk, dk, dv = s.key_heads, s.key_dim, s.value_dim
    r = s.value_heads // hk
    per = 2 * dk + 2 * r * dv
    if qkvz.shape[0] != hk * per:
        raise CheckpointError(f"{qkvz.source}: {qkvz.name} has {qkvz.shape[0]} rows, expected {hk * per}")
    base = torch.arange(hk).view(hk, 1) * per

    def rows(lo: int, n: int) -> torch.Tensor:
        return (base + lo + torch.arange(n).view(1, n)).reshape(-1)

    idx_qkv = torch.cat([rows(0, dk), rows(dk, dk), rows(2 * dk, r * dv)])
    qkv = take_rows(qkvz, idx_qkv, qkvz.name + ".qkv")
    z = take_rows(qkvz, rows(2 * dk + r * dv, r * dv), qkvz.name + ".z")
    b, a = _split_ba(ba, s)
    return [qkv, z, b, a]


def _split_ba(ba: RawTensor, s: DeltaNetShape) -> tuple[RawTensor, RawTensor]:
    hk = s.key_heads
    r = s.value_heads // hk
    base = torch.arange(hk).view(hk, 1) * 2 * r
    b = take_rows(ba, (base + torch.arange(r).view(1, r)).reshape(-1), ba.name + ".b")
    a = take_rows(ba, (base + r + torch.arange(r).view(1, r)).reshape(-1), ba.name + ".a")
    return b, a
