"""A pre-norm MoE decoder whose attention and routing details a family declares.

Qwen3-MoE, Mixtral, OLMoE and GPT-OSS share one shape: embedding, per layer RMSNorm -> GQA
attention with NeoX RoPE over the paged KV cache -> RMSNorm -> routed experts (or a dense
MLP where the config says), final RMSNorm and head. They differ in a few switches, which a
family module sets in :class:`Arch`: q/k RMSNorm per head (Qwen3-MoE) or over the whole
projection (OLMoE), q/k/v clipping, projection biases, a sliding window per layer and
attention sinks (GPT-OSS), RoPE on a leading part of each head (GLM-4.5), a router bias,
expert biases, the expert activation, grouped sigmoid routing with shared experts (GLM-4.5). The family
module reads the checkpoint's config and names, and builds the routed experts of a layer
(:attr:`Arch.experts`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor, TensorSource
from freetoken.models.attention import AttentionMetadata, paged_attention, write_kv
from freetoken.models.config import ModelConfig
from freetoken.models.decoder_base import DecoderModelBase
from freetoken.models.hybrid_weights import PartialRotary, rotary_permutation, take_rows
from freetoken.models.layers import FusedLinears, rms_norm
from freetoken.models.moe_block import swiglu_experts
from freetoken.models.rope import RopeScaling, make_rotary
from freetoken.models.routing import GroupedTopK
from freetoken.models.tensor_names import Names
from freetoken.models.moe_layer import ExpertWeights

logger = logging.getLogger(__name__)

__all__ = ["Arch", "MoeDecoderModel", "Names", "ExpertsBuilder", "swiglu_experts_builder", "unpermute_rows"]

#: (layer index, source, names, config) -> the layer's routed experts and, when they have
#: biases, the gate/up biases folded into the weights (see :class:`~freetoken.models.moe_block.BiasedMoELayer`) and
#: the down bias float32 ``[E, hidden]``
ExpertsBuilder = Callable[[int, TensorSource, Names, ModelConfig], tuple[ExpertWeights, Optional[torch.Tensor]]]


def swiglu_experts_builder(per_expert: Callable[[int, int, str], str]) -> ExpertsBuilder:
    """The experts of a family whose HF checkpoints store one tensor per expert
    (``per_expert(layer, expert, "gate"|"up"|"down")``) or transformers' fused
    ``mlp.experts.gate_up_proj``/``down_proj``, and whose GGUF files llama.cpp's stacked
    ``ffn_{gate,up,down}_exps`` (:func:`~freetoken.models.moe_block.swiglu_experts`)."""

    def build(i: int, source: TensorSource, names: Names, c: ModelConfig) -> tuple[ExpertWeights, None]:
        if names.fmt == "gguf":
            return swiglu_experts(i, source, c, stacked=lambda l, r: f"blk.{l}.ffn_{r}_exps.weight"), None
        fused = lambda l, r: f"model.layers.{l}.mlp.experts.{r}_proj"  # noqa: E731
        return swiglu_experts(i, source, c, per_expert=per_expert, fused=fused), None

    return build


@dataclasses.dataclass(frozen=True)
class Arch:
    """The switches of one family (see the module docstring)."""

    experts: ExpertsBuilder
    #: "none"; "head": RMSNorm per head of q and k (weights ``[head_dim]``); "full": RMSNorm
    #: over all heads' q (and k) before the split
    qk_norm: str = "none"
    clip_qkv: Optional[float] = None
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    router_bias: bool = False
    activation: str = "silu"
    #: per layer: sliding window (tokens) or None for full attention
    windows: tuple[Optional[int], ...] = ()
    rope: RopeScaling = RopeScaling()
    #: GGUF files of llama's converter store q/k rows permuted for interleaved RoPE:
    #: the loader undoes it (rows back in rotate-half order)
    unpermute_qk: bool = False
    #: expert hidden padding (columns) of experts with folded gate/up biases
    expert_pad: int = 0
    #: NeoX RoPE on the first ``rotary_dim`` dimensions of each head only (None: all). The
    #: loader reorders each head's q/k rows (and their biases and norms) so that the rotated
    #: pairs sit where full-width RoPE puts them (:func:`~freetoken.models.hybrid_weights.rotary_permutation`;
    #: q.k products are unchanged), and the tables leave the other dimensions alone
    rotary_dim: Optional[int] = None
    #: grouped sigmoid routing with a score-correction bias (role ``expert_bias``) instead
    #: of softmax top-k (:class:`~freetoken.models.moe_block.GroupedTopKMoELayer`)
    routing: Optional[GroupedTopK] = None
    #: ungated shared experts (roles ``shexp_gate``/``shexp_up``/``shexp_down``) beside
    #: ``routing``'s routed experts
    shared_experts: bool = False


class _Layer:
    __slots__ = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "qk_norm", "sinks",
                 "window", "moe", "mlp")  # fmt: skip


class MoeDecoderModel(DecoderModelBase):
    """The runnable model: weights placed by a :class:`WeightPolicy`, forward over a flat
    batch of tokens with paged KV."""

    arch: Arch  # set by the family's subclass

    def __init__(self, config: ModelConfig, source: TensorSource, names: Names, policy: WeightPolicy,
                 progress: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self._load_ends(config, source, names, policy)
        c = config
        self.arch = a = self.arch_for(config)
        D = c.head_dim
        order: Optional[torch.Tensor] = None  # each head's q/k dimensions in rotary order
        if a.rotary_dim is not None and a.rotary_dim != D:
            if a.rope.kind != "default":
                raise CheckpointError(f"RoPE scaling {a.rope.kind!r} with a partial rotary dimension is not supported")
            if not 0 < a.rotary_dim < D or a.rotary_dim % 2:
                raise CheckpointError(f"rotary dimension {a.rotary_dim} does not fit head_dim {D}")
            self.rotary = PartialRotary(D, a.rotary_dim, c.rope_theta, c.max_position_embeddings, self.device)
            order = rotary_permutation(D, a.rotary_dim)
        else:
            self.rotary = make_rotary(D, c.rope_theta, a.rope, c.max_position_embeddings, self.device)
        q_rows = k_rows = None
        if order is not None:
            q_rows = (torch.arange(c.num_heads).view(-1, 1) * D + order.view(1, D)).reshape(-1)
            k_rows = (torch.arange(c.num_kv_heads).view(-1, 1) * D + order.view(1, D)).reshape(-1)
        self.layers: list[_Layer] = []
        get = source.get
        permute = a.unpermute_qk and names.fmt == "gguf"
        for i in range(c.num_layers):
            L = _Layer()
            n = lambda role: get(names.layer(i, role))  # noqa: E731
            L.in_norm = policy.tensor(n("in_norm"))
            L.post_norm = policy.tensor(n("post_norm"))
            q, k = n("q"), n("k")
            if permute:
                q, k = unpermute_rows(q, c.num_heads), unpermute_rows(k, c.num_kv_heads)
            if q_rows is not None:
                _check_rows(q, c.num_heads * D)
                _check_rows(k, c.num_kv_heads * D)
                q, k = take_rows(q, q_rows, q.name), take_rows(k, k_rows, k.name)
            L.qkv = FusedLinears([q, k, n("v")], policy)
            L.qkv_bias = None
            if a.qkv_bias:
                qb, kb, vb = (policy.tensor(n(r)).float() for r in ("q_bias", "k_bias", "v_bias"))
                if q_rows is not None:
                    qb, kb = qb[q_rows.to(qb.device)].contiguous(), kb[k_rows.to(kb.device)].contiguous()
                L.qkv_bias = (qb, kb, vb)
            L.o = policy.linear(n("o"))
            L.o_bias = policy.tensor(n("o_bias")) if a.o_bias else None
            L.q_norm = L.k_norm = L.qk_norm = None
            if a.qk_norm != "none":
                L.q_norm, L.k_norm = policy.tensor(n("q_norm")), policy.tensor(n("k_norm"))
                if order is not None:  # per-head weights [D] in rotary order
                    L.q_norm = L.q_norm[order.to(L.q_norm.device)].contiguous()
                    L.k_norm = L.k_norm[order.to(L.k_norm.device)].contiguous()
            if a.qk_norm == "head" and len(L.qkv.groups[0][1]) >= 2:
                # q and k come out of one call: normalise and rotate them as one [T, Hq+Hkv, D] view
                L.qk_norm = torch.cat([L.q_norm.expand(c.num_heads, c.head_dim),
                                       L.k_norm.expand(c.num_kv_heads, c.head_dim)]).contiguous()  # fmt: skip
            L.sinks = policy.tensor(n("sinks")).float() if a.sinks else None
            L.window = a.windows[i] if a.windows else None
            self._load_ffn(L, i, n, policy, lambda: a.experts(i, source, names, c), router_bias=a.router_bias,
                           activation=a.activation, routing=a.routing, shared=a.shared_experts)  # fmt: skip
            self.layers.append(L)
            if progress is not None:
                progress(i)

    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        raise NotImplementedError

    # ---------------------------------------------------------------- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """Final-normed hidden states ``[T, hidden]`` of the step's tokens."""
        c, a = self.config, self.arch
        eps = c.rms_norm_eps
        ops = self.ops
        T = input_ids.shape[0]
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        h = self.embed(input_ids)
        slots = meta.slot_mapping
        head_norm = a.qk_norm == "head"  # the norm-and-RoPE op reads its own tables
        if not head_norm:
            cos, sin = self.rotary.tables(positions, h.dtype)
        delta: Optional[torch.Tensor] = None  # what the previous block adds to h
        for L, (kc, vc) in zip(self.layers, kv_caches):
            h, (q, k, v) = L.qkv.add_norm_call(ops, h, delta, L.in_norm, eps)
            if head_norm:
                if L.qkv_bias is not None:  # the biases come before the norms
                    q, k, v = (t + b.to(t.dtype) for t, b in zip((q, k, v), L.qkv_bias))
                qh = ops.qk_norm_rope_store(q, k, v, L.q_norm, L.k_norm, L.qk_norm, self.rotary, positions, kc, vc,
                                            slots, eps)  # fmt: skip
            elif L.q_norm is None and a.clip_qkv is None:  # bias, RoPE and the K/V write: one op
                qh = ops.bias_rope_store(q, k, v, L.qkv_bias, self.rotary, cos, sin, positions, kc, vc, slots)
            else:
                if L.qkv_bias is not None:
                    q, k, v = (t + b.to(t.dtype) for t, b in zip((q, k, v), L.qkv_bias))
                if L.q_norm is not None:
                    q, k = rms_norm(q, L.q_norm, eps), rms_norm(k, L.k_norm, eps)
                if a.clip_qkv is not None:
                    q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
                qh = self.rotary.apply(q.reshape(T, Hq, D), cos, sin)
                kh = self.rotary.apply(k.reshape(T, Hkv, D), cos, sin)
                write_kv(kc, vc, kh, v.reshape(T, Hkv, D), slots)
            o = L.o(paged_attention(qh, kc, vc, meta, self.scale, window=L.window, sinks=L.sinks))
            if L.o_bias is not None:
                o = o + L.o_bias
            h, delta = self._feed_forward(L, h, o, eps)
        return ops.add_rms_norm(h, delta, self.norm, eps)[1]

    # ------------------------------------------------------------- accounting

    def _mixer_bytes(self, L: _Layer) -> int:
        return L.qkv.nbytes + L.o.nbytes


def _check_rows(raw: RawTensor, rows: int) -> None:
    if raw.shape[0] != rows:
        raise CheckpointError(f"{raw.source}: {raw.name} has {raw.shape[0]} rows, expected {rows}")


def unpermute_rows(raw: RawTensor, heads: int) -> RawTensor:
    """Undo llama.cpp's converter permutation of q/k rows (per head, rows ``[a0, b0, a1,
    b1, ...]`` of the interleaved-RoPE layout back to ``[a0, a1, ..., b0, b1, ...]``);
    rows move whole, so packed formats stay packed."""
    from freetoken.loading.tensors import RawTensor

    rows = raw.shape[0]
    half = rows // heads // 2
    # stored row (h, j, t) = h*2*half + 2*j + t holds original row h*2*half + t*half + j
    order = torch.arange(rows).view(heads, 2, half).transpose(1, 2).reshape(-1)  # original row of each stored row
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows)
    data = raw.raw_torch()[inverse].contiguous()
    return RawTensor(raw.name, raw.shape, raw.fmt, data, raw.source, raw.scale)

