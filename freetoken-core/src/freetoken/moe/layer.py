"""The MoE layer as the model sees it: router -> top-k -> routed experts.

The router and the top-k selection are torch ops on the dense part's device. The
routed experts run through the backend contract:

* CPU backend (``IOPath.SYNCHRONOUS``, ``SyncMode.SYNCHRONOUS``): the activations
  already live in host memory, so the layer calls the CPU kernels directly
  (``freetoken_cpu_moe.moe_forward`` on the layer's :class:`ExpertBank`); there is
  no hand-off to order against a stream.
* GPU backends: the hybrid layer (``freetoken.moe.hybrid``) splits the routes
  between GPU-resident experts and the CPU and hands the CPU part over through
  GpuSync/KernelIO. A backend plugs in by giving :meth:`MoELayer.set_experts` a
  callable with the same signature as :meth:`MoELayer.run_experts`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from freetoken.loading.tensors import RawTensor
from freetoken.models.layers import cm_weights, cpu_moe

logger = logging.getLogger(__name__)

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    """Router + top-k softmax routing + routed SwiGLU experts of one decoder layer."""

    def __init__(
        self,
        layer: int,
        router: torch.Tensor,
        experts: ExpertWeights,
        top_k: int,
        norm_topk_prob: bool,
        device: torch.device,
        activation: str = "silu",
    ) -> None:
        self.layer = layer
        self.router = router  # [E, H] float on the dense device
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.device = torch.device(device)
        self.activation = activation
        self.bank: Any = None
        self._router_w: Any = None
        self._experts_fn: Optional[ExpertsFn] = None
        # The routed experts stay in host memory in their checkpoint format on every
        # backend: the CPU workers read them through this bank (its ``address`` is what
        # a GPU backend's hand-off tasks point at).
        self._build_cpu_bank()
        if self.device.type == "cpu":
            self._experts_fn = self._run_cpu_synchronous

    def _build_cpu_bank(self) -> None:
        cm = cpu_moe()
        e = self.experts
        gate = cm_weights(e.gate, e.num_experts, e.intermediate, e.hidden)
        up = cm_weights(e.up, e.num_experts, e.intermediate, e.hidden)
        down = cm_weights(e.down, e.num_experts, e.hidden, e.intermediate)
        self.bank = cm.ExpertBank(gate, up, down, activation=self.activation)
        self._moe_forward = cm.moe_forward
        self._pool = cm.default_pool()
        if self.device.type == "cpu":
            # the router is a small dense projection: run it on the same worker pool
            self.router = self.router.float().contiguous()
            self._router_w = cm.Weights(self.router, "f32", 1, int(self.router.shape[0]), int(self.router.shape[1]))
            self._router_linear = cm.linear

    def set_experts(self, fn: ExpertsFn) -> None:
        """Install the routed-experts implementation of a (GPU) backend."""
        self._experts_fn = fn

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids (int32 [T, K]) and weights (float32 [T, K]) for ``x``."""
        if self._router_w is not None:
            logits = self._router_linear(self._router_w, x, torch.float32, self._pool)
        else:
            logits = torch.nn.functional.linear(x, self.router)
        if self.norm_topk_prob:
            # softmax over all experts then renormalised over the top-k == softmax of the top-k logits
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids.to(torch.int32), torch.softmax(top, dim=-1, dtype=torch.float32)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids.to(torch.int32), w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        return self.run_experts(x, ids, w)

    __call__ = forward

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self._experts_fn is None:
            raise RuntimeError(
                f"MoE layer {self.layer}: no routed-experts path for device {self.device}; the backend must "
                "install one (freetoken.moe.hybrid) before the model runs"
            )
        return self._experts_fn(x, ids, w)

    def _run_cpu_synchronous(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # IOPath.SYNCHRONOUS: activations are host memory already; run the CPU kernels now.
        return self._moe_forward(self.bank, x.contiguous(), ids.contiguous(), w.contiguous(), x.dtype, self._pool)
