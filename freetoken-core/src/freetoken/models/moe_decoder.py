"""A pre-norm MoE decoder whose attention and routing details a family declares.

Mixtral, OLMoE and GPT-OSS share one shape: embedding, per layer RMSNorm -> GQA attention
with NeoX RoPE over the paged KV cache -> RMSNorm -> routed experts, final RMSNorm and
head. They differ in a few switches, which a family module sets in :class:`Arch`: q/k
RMSNorm over the whole projection (OLMoE), q/k/v clipping, projection biases, a sliding
window per layer and attention sinks (GPT-OSS), a router bias, expert biases, the expert
activation. The family module reads the checkpoint's config and names, and builds the
routed experts of a layer (:attr:`Arch.experts`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.tensors import TensorSource
from freetoken.models.attention import AttentionMetadata, paged_attention, write_kv
from freetoken.models.config import ModelConfig
from freetoken.models.dense_ops import dense_ops_for
from freetoken.models.layers import FusedLinears, rms_norm
from freetoken.models.rope import RopeScaling, make_rotary
from freetoken.models.moe_layer import ExpertWeights, MoELayer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Names:
    """Where each weight lives in one checkpoint format; ``layer(i, role)`` names a layer's
    tensor by role (``in_norm``, ``post_norm``, ``q``/``k``/``v``/``o`` and their
    ``*_bias``, ``q_norm``, ``k_norm``, ``sinks``, ``router``, ``router_bias``)."""

    embed: str
    norm: str
    lm_head: str
    layer: Callable[[int, str], str]
    fmt: str  # "hf" | "gguf"


#: (layer index, source, names, config) -> the layer's routed experts and, when they have
#: biases, the gate/up biases folded into the weights (see :class:`BiasedMoELayer`) and
#: the down bias float32 ``[E, hidden]``
ExpertsBuilder = Callable[[int, TensorSource, Names, ModelConfig], tuple[ExpertWeights, Optional[torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class Arch:
    """The switches of one family (see the module docstring)."""

    experts: ExpertsBuilder
    qk_norm: str = "none"  # "none" | "full": RMSNorm over all heads' q (and k) before the split
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


#: the constant the folded gate/up biases of :class:`BiasedMoELayer` multiply: columns
#: ``hidden .. hidden + BIAS_PAD`` of the experts' input hold ``BIAS_ONES`` ones, then
#: ``BIAS_FINE`` (1/127). Both are exact in the kernels' int8 activation blocks (absmax 1:
#: codes 127 and 1 at scale 1/127), so a block format whose one value per element is
#: coarse (MXFP4) can spread a bias over a coarse and a fine half; formats that hold the
#: bias in the block's first element (Q8_0, the float formats) see only the first 1.
BIAS_PAD, BIAS_ONES, BIAS_FINE = 32, 16, 1.0 / 127


class BiasedRouter:
    """Router logits ``x W^T + b`` in float32."""

    def __init__(self, linear: object, bias: torch.Tensor) -> None:
        self.linear = linear
        self.bias = bias
        self.nbytes = linear.nbytes + bias.numel() * 4  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias  # type: ignore[operator]


class BiasedMoELayer(MoELayer):
    """Routed experts with biases on their gate, up and down projections, on expert
    kernels that have none: the gate/up biases are an extra weight block per row that
    multiplies a constant appended to the activations (:data:`BIAS_PAD` columns, see
    there; the experts' hidden size is ``hidden + pad``; the extra down rows are zero and
    their outputs dropped), the down bias is ``sum_k w_k b_down[e_k]`` added after the
    experts."""

    def __init__(self, layer: int, router: object, experts: ExpertWeights, top_k: int, norm_topk_prob: bool,
                 activation: str, hidden: int, down_bias: torch.Tensor) -> None:  # fmt: skip
        super().__init__(layer, router, experts, top_k, norm_topk_prob, activation)  # type: ignore[arg-type]
        self.hidden = hidden
        self.pad = experts.hidden - hidden
        if self.pad != BIAS_PAD:
            raise ValueError(f"layer {layer}: experts with folded biases need hidden + {BIAS_PAD} columns, "
                             f"got {experts.hidden} for hidden {hidden}")  # fmt: skip
        self.down_bias = down_bias.contiguous()  # float32 [E, H]
        self._ext: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _bias_columns(self, x: torch.Tensor) -> torch.Tensor:
        """The constant appended to the experts' input, ``[1, pad]`` in x's dtype and device
        (made once per kind)."""
        key = (x.dtype, x.device)
        ext = self._ext.get(key)
        if ext is None:
            ext = torch.zeros(1, self.pad, dtype=x.dtype, device=x.device)
            ext[:, :BIAS_ONES] = 1
            ext[:, BIAS_ONES:BIAS_PAD] = BIAS_FINE
            self._ext[key] = ext
        return ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        ext = self._bias_columns(x).expand(x.shape[0], self.pad)
        y = self.run_experts(torch.cat([x, ext], dim=1), ids, w)  # [T, hidden + pad]
        return self.ops.moe_bias_add(y, ids, w, self.down_bias, self.hidden, x.dtype)

    __call__ = forward


class _Layer:
    __slots__ = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "sinks", "window",
                 "moe")  # fmt: skip


class MoeDecoderModel:
    """The runnable model: weights placed by a :class:`WeightPolicy`, forward over a flat
    batch of tokens with paged KV."""

    arch: Arch  # set by the family's subclass

    def __init__(self, config: ModelConfig, source: TensorSource, names: Names, policy: WeightPolicy,
                 progress: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self.config = c = config
        a = self.arch_for(config)
        self.arch = a
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
        self.rotary = make_rotary(c.head_dim, c.rope_theta, a.rope, c.max_position_embeddings, self.device)
        self.ops = dense_ops_for(self.device)
        self.layers: list[_Layer] = []
        permute = a.unpermute_qk and names.fmt == "gguf"
        for i in range(c.num_layers):
            L = _Layer()
            n = lambda role: get(names.layer(i, role))  # noqa: E731
            L.in_norm = policy.tensor(n("in_norm"))
            L.post_norm = policy.tensor(n("post_norm"))
            q, k = n("q"), n("k")
            if permute:
                q, k = unpermute_rows(q, c.num_heads), unpermute_rows(k, c.num_kv_heads)
            L.qkv = FusedLinears([q, k, n("v")], policy)
            L.qkv_bias = None
            if a.qkv_bias:
                L.qkv_bias = tuple(policy.tensor(n(r)).float() for r in ("q_bias", "k_bias", "v_bias"))
            L.o = policy.linear(n("o"))
            L.o_bias = policy.tensor(n("o_bias")) if a.o_bias else None
            L.q_norm = L.k_norm = None
            if a.qk_norm == "full":
                L.q_norm, L.k_norm = policy.tensor(n("q_norm")), policy.tensor(n("k_norm"))
            L.sinks = policy.tensor(n("sinks")).float() if a.sinks else None
            L.window = a.windows[i] if a.windows else None
            experts, down_bias = a.experts(i, source, names, c)
            router = policy.router(n("router"))
            if a.router_bias:
                router = BiasedRouter(router, policy.tensor(n("router_bias")).float())
            if down_bias is not None:
                L.moe = BiasedMoELayer(i, router, experts, c.top_k, c.norm_topk_prob, a.activation, c.hidden_size,
                                       down_bias.float().to(self.device))  # fmt: skip
            else:
                L.moe = MoELayer(i, router, experts, c.top_k, c.norm_topk_prob, a.activation)  # type: ignore[arg-type]
            L.moe.ops = self.ops
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
        cos, sin = self.rotary.tables(positions, h.dtype)
        delta: Optional[torch.Tensor] = None
        for L, (kc, vc) in zip(self.layers, kv_caches):
            h, (q, k, v) = L.qkv.add_norm_call(ops, h, delta, L.in_norm, eps)
            if L.q_norm is None and a.clip_qkv is None:  # bias, RoPE and the K/V write: one op
                qh = ops.bias_rope_store(q, k, v, L.qkv_bias, self.rotary, cos, sin, positions, kc, vc,
                                         meta.slot_mapping)  # fmt: skip
            else:
                if L.qkv_bias is not None:
                    q, k, v = (t + b.to(t.dtype) for t, b in zip((q, k, v), L.qkv_bias))
                if L.q_norm is not None:
                    q, k = rms_norm(q, L.q_norm, eps), rms_norm(k, L.k_norm, eps)
                if a.clip_qkv is not None:
                    q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
                qh = self.rotary.apply(q.reshape(T, Hq, D), cos, sin)
                kh = self.rotary.apply(k.reshape(T, Hkv, D), cos, sin)
                write_kv(kc, vc, kh, v.reshape(T, Hkv, D), meta.slot_mapping)
            o = L.o(paged_attention(qh, kc, vc, meta, self.scale, window=L.window, sinks=L.sinks))
            if L.o_bias is not None:
                o = o + L.o_bias
            h, delta = L.moe.add_norm_forward(h, o, L.post_norm, eps)
        return ops.add_rms_norm(h, delta, self.norm, eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------- accounting

    def bytes_per_token(self) -> dict[str, int]:
        """Weight bytes one decode token reads (batch 1): dense part and experts."""
        dense = self.lm_head.nbytes
        experts = 0
        for L in self.layers:
            dense += L.qkv.nbytes + L.o.nbytes + L.moe.router.nbytes
            experts += self.config.top_k * L.moe.experts.bytes_per_expert
        return {"dense": dense, "experts": experts}


def unpermute_rows(raw: "RawTensor", heads: int) -> "RawTensor":  # noqa: F821
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



def hf_eos_ids(cfg: dict, generation_config: Optional[dict]) -> tuple[int, ...]:
    """End-of-sequence ids of an HF config and its generation config, in order, unique."""
    eos: list[int] = []
    for src in (generation_config or {}, cfg):
        v = src.get("eos_token_id")
        if v is None:
            continue
        for e in v if isinstance(v, list) else [v]:
            if int(e) not in eos:
                eos.append(int(e))
    return tuple(eos)


def swiglu_experts(i: int, source: TensorSource, names: Names, c: ModelConfig,
                   per_expert: Callable[[int, int, str], str], fused: Callable[[int, str], str]) -> ExpertWeights:  # fmt: skip
    """A layer's gate/up/down experts from HF per-expert tensors (``per_expert(layer,
    expert, "gate"|"up"|"down")``), transformers' fused ``gate_up_proj [E, 2I, H]`` +
    ``down_proj [E, H, I]`` (``fused(layer, "gate_up"|"down")``), or GGUF's stacked
    ``ffn_{gate,up,down}_exps``."""
    from freetoken.loading.hf import CheckpointError
    from freetoken.loading.tensors import RawTensor
    from freetoken.models.moe_layer import stack_experts

    E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
    if names.fmt == "gguf":
        gate, up, down = (source.get(f"blk.{i}.ffn_{r}_exps.weight") for r in ("gate", "up", "down"))
    elif source.has(per_expert(i, 0, "gate")):
        gate, up, down = (stack_experts([source.get(per_expert(i, e, r)) for e in range(E)], f"layer{i}.{r}")
                          for r in ("gate", "up", "down"))  # fmt: skip
    else:
        gu = source.get(fused(i, "gate_up"))
        t = gu.raw_torch()
        gate = RawTensor(gu.name, (E, I, H), gu.fmt, t[:, :I].contiguous(), gu.source)
        up = RawTensor(gu.name, (E, I, H), gu.fmt, t[:, I:].contiguous(), gu.source)
        down = source.get(fused(i, "down"))
    for t, shape in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{t.source}: {t.name} has shape {tuple(t.shape)}, expected {shape}")
    return ExpertWeights(gate, up, down, E, H, I)
