"""The MoE layer as the model sees it: router -> top-k -> routed experts.

The router and the top-k selection run on the dense part's device through the weight
policy's router linear. The routed experts run through an experts function that the
backend's model session builds per layer (:meth:`ModelSession.routed_experts`): the CPU
backend calls the CPU kernels synchronously, a GPU backend splits the routes between
GPU-resident experts and the CPU workers and hands the CPU part over through
GpuSync/KernelIO (:mod:`freetoken.moe.handoff.hybrid`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch

from freetoken.backends.contract import BesideFn, ExpertsFn, Linear, MoELayerSpec, OverlappedExpertsFn
from freetoken.loading.tensors import RawTensor
from freetoken.models.dense_ops import TORCH_OPS, DenseOps

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class ExpertWeights:
    """The routed experts of one layer in their checkpoint format.

    gate/up are ``[E, I, H]``, down ``[E, H, I]``; each is one RawTensor whose data
    is one buffer of ``E`` consecutive expert matrices.
    """

    gate: RawTensor
    up: RawTensor
    down: RawTensor
    num_experts: int
    hidden: int
    intermediate: int

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @property
    def bytes_per_expert(self) -> int:
        return self.nbytes // self.num_experts


def stack_experts(parts: Sequence[RawTensor], name: str) -> RawTensor:
    """Stack per-expert matrices (HF checkpoints store one tensor per expert) into
    one ``[E, rows, cols]`` buffer in the stored dtype (the single copy we make)."""
    first = parts[0]
    for p in parts:
        if p.shape != first.shape or p.fmt != first.fmt:
            raise ValueError(f"{p.source}: expert tensor {p.name} has shape {p.shape}/format {p.fmt}, expected {first.shape}/{first.fmt}")
    data = torch.stack([p.raw_torch() for p in parts])
    scale = None
    if first.scale is not None:
        scale = torch.stack([p.scale for p in parts]).contiguous()
    return RawTensor(name=name, shape=(len(parts), *first.shape), fmt=first.fmt, data=data, source=first.source, scale=scale)


class MoELayer:
    """Router + top-k softmax routing + routed SwiGLU experts of one decoder layer.

    ``router`` is the policy's router linear (float32 logits); the routed experts run
    through the function the backend's :class:`~freetoken.backends.contract.ModelSession`
    built for this layer (:meth:`set_experts`), so this class never knows where they run.
    """

    def __init__(
        self,
        layer: int,
        router: Linear,
        experts: ExpertWeights,
        top_k: int,
        norm_topk_prob: bool,
        activation: str = "silu",
    ) -> None:
        self.layer = layer
        self.router = router
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.activation = activation
        self._experts_fn: Optional[ExpertsFn] = None
        #: the implementation of the top-k selection (the model sets it for its device)
        self.ops: DenseOps = TORCH_OPS

    def spec(self) -> MoELayerSpec:
        """What a backend gets to build this layer's experts function."""
        return MoELayerSpec(self.layer, self.experts, self.top_k, self.activation)

    def set_experts(self, fn: ExpertsFn) -> None:
        """Install the routed-experts function (the engine does, from the model session)."""
        self._experts_fn = fn

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids (int32 [T, K]) and weights (float32 [T, K]) for ``x``."""
        return self.ops.router_top_k(self.router(x), self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        return self.from_routes(x, ids, w)

    def from_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x`` routed to ``ids`` with weights ``w``: the routed
        experts (a subclass may add what its layer computes around them)."""
        return self.run_experts(x, ids, w)

    __call__ = forward

    def add_norm_forward(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The residual ``h + delta`` and this layer's output for its RMSNorm (times
        ``weight``): :meth:`fused_route` (:meth:`DenseOps.add_norm_route`, or the grouped form)
        where the ops fuse the norm with the router and its choice (one launch instead of three
        per decode step), then :meth:`from_routes`; else ``add_rms_norm`` then :meth:`forward`.
        A subclass that changes :meth:`forward` (not only :meth:`from_routes`), or a
        :meth:`route` replaced on the instance or class (a recorder), takes the second way."""
        fused = None
        if (type(self).forward is _PLAIN_FORWARD and type(self).route is _FUSED_ROUTES.get(type(self), _PLAIN_ROUTE)
                and "route" not in vars(self)):
            fused = self.fused_route(h, delta, weight, eps)
        if fused is None:
            h, x = self.ops.add_rms_norm(h, delta, weight, eps)
            return h, self.forward(x)
        h, x, ids, w = fused
        return h, self.from_routes(x, ids, w)

    def fused_route(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        """:meth:`route`'s choice fused with the pre-norm by the dense ops (``(h + delta, x,
        ids, w)``), or None where they do not fuse it. A subclass whose :meth:`route` differs
        overrides both and registers the pair (:func:`fuses_route`)."""
        return self.ops.add_norm_route(h, delta, weight, eps, self.router, self.top_k, self.norm_topk_prob)

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    beside: Optional[BesideFn] = None) -> torch.Tensor:  # fmt: skip
        """The routed experts' output, plus ``beside()`` (work independent of them, such as a
        shared expert) where given: run while the experts run elsewhere where the function
        can (:class:`~freetoken.backends.contract.OverlappedExpertsFn`), else after them."""
        fn = self._experts_fn
        if fn is None:
            raise RuntimeError(
                f"MoE layer {self.layer}: no routed-experts function; the engine installs one from the "
                "backend's model session (ModelSession.routed_experts) before the model runs"
            )
        if beside is None:
            return fn(x, ids, w)
        if isinstance(fn, OverlappedExpertsFn):
            return fn.run(x, ids, w, beside)
        return fn(x, ids, w) + beside()


#: the class's own route and forward, kept apart from the class attributes: a recorder that
#: replaces ``MoELayer.route`` itself must still turn the fused routing off
_PLAIN_ROUTE = MoELayer.route
_PLAIN_FORWARD = MoELayer.forward
#: subclasses with their own :meth:`MoELayer.route` and a :meth:`MoELayer.fused_route` of it, by
#: class: the route as the class defines it (one replaced later, a recorder, turns the fusion off)
_FUSED_ROUTES: dict[type, Any] = {}


def fuses_route(cls: type) -> type:
    """Class decorator: ``cls.fused_route`` computes ``cls.route``'s choice (kept as defined now)."""
    _FUSED_ROUTES[cls] = cls.route
    return cls
