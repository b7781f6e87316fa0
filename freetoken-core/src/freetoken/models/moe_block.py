"""The feed-forward block of a decoder layer as the families build it: routed experts
(:class:`~freetoken.models.moe_layer.MoELayer`: router, softmax top-k, optional renormalisation,
the backend's experts), with a router bias and expert biases where the family has them
(:class:`BiasedMoELayer`), or a gated shared expert beside them
(:class:`SharedExpertMoELayer`), or grouped top-k routing (sigmoid with a score-correction
bias, or softmax) and ungated shared experts (:class:`GroupedTopKMoELayer`, GLM-4.5 and the
DeepSeek family); or a dense SwiGLU MLP
(:class:`SwiGLU`). Also the
loader of a layer's SwiGLU expert stacks in the checkpoint layouts the families share
(:func:`swiglu_experts`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor, TensorSource
from freetoken.models.config import ModelConfig
from freetoken.models.dense_ops import DenseOps
from freetoken.models.layers import BiasedRouter, FusedLinears
from freetoken.models.moe_layer import ExpertWeights, MoELayer, fuses_route, stack_experts
from freetoken.models.routing import GroupedTopK

#: the constant the folded gate/up biases of :class:`BiasedMoELayer` multiply: columns
#: ``hidden .. hidden + BIAS_PAD`` of the experts' input hold ``BIAS_ONES`` ones, then
#: ``BIAS_FINE`` (1/127). Both are exact in the kernels' int8 activation blocks (absmax 1:
#: codes 127 and 1 at scale 1/127), so a block format whose one value per element is
#: coarse (MXFP4) can spread a bias over a coarse and a fine half; formats that hold the
#: bias in the block's first element (Q8_0, the float formats) see only the first 1.
BIAS_PAD, BIAS_ONES, BIAS_FINE = 32, 16, 1.0 / 127


class SwiGLU:
    """``down(silu(gate(x)) * up(x))`` with gate and up as one :class:`FusedLinears`: a
    dense MLP layer, or a shared expert."""

    def __init__(self, gate_up: FusedLinears, down: object) -> None:
        self.gate_up = gate_up
        self.down = down
        self.nbytes = gate_up.nbytes + down.nbytes  # type: ignore[attr-defined]

    @classmethod
    def load(cls, get: Callable[[str], RawTensor], policy: WeightPolicy, prefix: str) -> "SwiGLU":
        """From the roles ``{prefix}_gate``, ``{prefix}_up`` and ``{prefix}_down``."""
        gate_up = FusedLinears([get(f"{prefix}_gate"), get(f"{prefix}_up")], policy)
        return cls(gate_up, policy.linear(get(f"{prefix}_down")))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x)
        return self.down(F.silu(g) * u)  # type: ignore[operator]


class SharedExpertMoELayer(MoELayer):
    """Routed experts plus a shared SwiGLU expert scaled by ``sigmoid(x . w_gate)``."""

    def __init__(self, layer: int, router: object, experts: ExpertWeights, top_k: int, norm_topk_prob: bool,
                 shared: SwiGLU, shared_gate: torch.Tensor) -> None:  # fmt: skip
        super().__init__(layer, router, experts, top_k, norm_topk_prob)  # type: ignore[arg-type]
        self.shared = shared
        self.shared_gate = shared_gate  # [hidden]

    def from_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def shared() -> torch.Tensor:
            gate = torch.sigmoid(x @ self.shared_gate.to(x.dtype)).unsqueeze(-1)
            return gate * self.shared(x)

        return self.run_experts(x, ids, w, beside=shared)


@fuses_route
class GroupedTopKMoELayer(MoELayer):
    """Routed experts chosen by :func:`~freetoken.models.routing.grouped_sigmoid_top_k`
    (sigmoid scores, the correction bias for the choice only, grouped top-k, renormalised and
    scaled weights) or, for ``routing.scoring == "softmax"`` (no correction bias),
    :func:`~freetoken.models.routing.grouped_softmax_top_k`, through the dense ops'
    :meth:`~freetoken.models.dense_ops.DenseOps.grouped_top_k` (one launch on a GPU); plus
    shared experts added unscaled when the layer has them."""

    def __init__(self, layer: int, router: object, experts: ExpertWeights, routing: GroupedTopK,
                 correction_bias: Optional[torch.Tensor], shared: Optional[SwiGLU] = None) -> None:  # fmt: skip
        super().__init__(layer, router, experts, routing.top_k, routing.norm_topk_prob)  # type: ignore[arg-type]
        if (correction_bias is None) != (routing.scoring == "softmax"):
            raise ValueError(f"layer {layer}: {routing.scoring} routing "
                             f"{'needs' if correction_bias is None else 'takes no'} correction bias")  # fmt: skip
        self.routing = routing
        self.correction_bias = correction_bias  # float32 [E]
        self.shared = shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.grouped_top_k(self.router(x), self.correction_bias, self.routing)  # type: ignore[operator]

    def fused_route(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        return self.ops.add_norm_grouped_route(h, delta, weight, eps, self.router, self.correction_bias, self.routing)

    def from_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        return self.run_experts(x, ids, w, beside=None if shared is None else lambda: shared(x))


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

    def from_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ext = self._bias_columns(x).expand(x.shape[0], self.pad)
        y = self.run_experts(torch.cat([x, ext], dim=1), ids, w)  # [T, hidden + pad]
        return self.ops.moe_bias_add(y, ids, w, self.down_bias, self.hidden, x.dtype)


def moe_layer(i: int, c: ModelConfig, get: Callable[[str], RawTensor], policy: WeightPolicy, ops: DenseOps,
              experts: ExpertWeights, *, down_bias: Optional[torch.Tensor] = None, router_bias: bool = False,
              activation: str = "silu", shared: bool = False,
              routing: Optional[GroupedTopK] = None) -> MoELayer:  # fmt: skip
    """Layer ``i``'s routed-experts block: the router of role ``router`` (plus
    ``router_bias``), ``experts``, their down bias when they have biases (float32 ``[E,
    hidden]``; :class:`BiasedMoELayer`), or, with ``routing``, grouped top-k routing (sigmoid:
    with the correction bias of role ``expert_bias``; softmax: none) and (``shared``) the
    ungated shared experts of roles ``shexp_*`` (:class:`GroupedTopKMoELayer`), or the shared expert of roles
    ``shexp_*`` with its gate ``shexp_router`` (:class:`SharedExpertMoELayer`); its top-k on
    ``ops``."""
    router = policy.router(get("router"))
    if router_bias:
        router = BiasedRouter(router, policy.tensor(get("router_bias")).float())
    moe: MoELayer
    if down_bias is not None:
        moe = BiasedMoELayer(i, router, experts, c.top_k, c.norm_topk_prob, activation, c.hidden_size,
                             down_bias.float().to(policy.device))  # fmt: skip
    elif routing is not None:
        correction: Optional[torch.Tensor] = None
        if routing.scoring == "sigmoid":
            bias = get("expert_bias")
            if tuple(bias.shape) != (c.num_experts,):
                raise CheckpointError(f"{bias.source}: {bias.name} has shape {tuple(bias.shape)}, "
                                      f"expected ({c.num_experts},)")  # fmt: skip
            correction = bias.to_float(torch.float32).to(policy.device)
        moe = GroupedTopKMoELayer(i, router, experts, routing, correction,
                                  SwiGLU.load(get, policy, "shexp") if shared else None)  # fmt: skip
    elif shared:
        moe = SharedExpertMoELayer(i, router, experts, c.top_k, c.norm_topk_prob, SwiGLU.load(get, policy, "shexp"),
                                   policy.tensor(get("shexp_router")).reshape(-1))  # fmt: skip
    else:
        moe = MoELayer(i, router, experts, c.top_k, c.norm_topk_prob, activation)  # type: ignore[arg-type]
    moe.ops = ops
    return moe


def moe_dense_bytes(moe: MoELayer) -> int:
    """Bytes of a routed-experts block's weights other than the routed experts (router,
    shared expert) that one token reads."""
    nbytes = moe.router.nbytes  # type: ignore[attr-defined]
    if isinstance(moe, (SharedExpertMoELayer, GroupedTopKMoELayer)) and moe.shared is not None:
        nbytes += moe.shared.nbytes
    return nbytes


def swiglu_experts(i: int, source: TensorSource, c: ModelConfig, *,
                   per_expert: Optional[Callable[[int, int, str], str]] = None,
                   fused: Optional[Callable[[int, str], str]] = None,
                   stacked: Optional[Callable[[int, str], str]] = None) -> ExpertWeights:  # fmt: skip
    """Layer ``i``'s gate/up/down experts (``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]``)
    from, the first the checkpoint has: HF per-expert tensors (``per_expert(layer, expert,
    "gate"|"up"|"down")``), a fused ``gate_up [E, 2I, H]`` (gate rows first; transformers'
    and llama.cpp's alike) with its ``down [E, H, I]`` (``fused(layer, "gate_up"|"down")``),
    or stacked ``gate``/``up``/``down`` (``stacked(layer, "gate"|"up"|"down")``, GGUF's
    ``ffn_*_exps``). Without ``stacked``, the fused tensors are read when there are no
    per-expert ones."""
    E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
    if per_expert is not None and source.has(per_expert(i, 0, "gate")):
        gate, up, down = (stack_experts([source.get(per_expert(i, e, r)) for e in range(E)], f"layer{i}.{r}")
                          for r in ("gate", "up", "down"))  # fmt: skip
    elif fused is not None and (stacked is None or source.has(fused(i, "gate_up"))):
        gu = source.get(fused(i, "gate_up"))
        if gu.scale is not None:
            raise CheckpointError(f"{gu.source}: block-scaled fused expert tensor {gu.name} is not supported")
        t = gu.raw_torch().reshape(E, 2 * I, -1)
        gate = RawTensor(gu.name + ".gate", (E, I, H), gu.fmt, t[:, :I].contiguous(), gu.source)
        up = RawTensor(gu.name + ".up", (E, I, H), gu.fmt, t[:, I:].contiguous(), gu.source)
        down = source.get(fused(i, "down"))
    elif stacked is not None:
        gate, up, down = (source.get(stacked(i, r)) for r in ("gate", "up", "down"))
    else:
        raise CheckpointError(f"layer {i}: no expert tensors found")
    for t, shape in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{t.source}: {t.name} has shape {tuple(t.shape)}, expected {shape}")
    return ExpertWeights(gate, up, down, E, H, I)
