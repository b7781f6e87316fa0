"""The per-token operations of a decoder layer around its matmuls, in two implementations.

A decode step at batch 1 is dominated on a GPU by how many kernels it launches, not by
their work: in plain torch ops, an RMSNorm in bfloat16 is seven kernels, q/k norm with
RoPE and the K/V cache write a dozen, the router's top-k and softmax five. The model calls
these operations through a :class:`DenseOps`:

* :class:`TorchDenseOps` -- plain torch ops (any device; the CPU backend's path and the
  reference the other is tested against);
* :class:`TritonDenseOps` -- one Triton kernel per operation
  (:mod:`freetoken.kernels.dense_ops`), where Triton runs
  (:mod:`freetoken.backends.triton_target`: NVIDIA compute capability >= 8.0, AMD CDNA2-4 and RDNA3/4).

Both compute in float32 and round to the activation dtype at the same points. Everything
they launch is capturable in a CUDA graph (shapes come from the arguments, values are read
on the device). :func:`dense_ops_for` picks one for a device (``FREETOKEN_DENSE_OPS``
= ``torch`` forces the plain ops everywhere). A backend with its own implementation for a
device type installs it with :func:`use_dense_ops` before its model is built (the CPU
backend: one native call per operation, ``freetoken_cpu_moe.decode_ops``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional

import torch

from freetoken.models.layers import Rotary, rms_norm, rms_norm_heads

log = logging.getLogger(__name__)

ENV = "FREETOKEN_DENSE_OPS"

#: the widest rows :meth:`TritonDenseOps.add_norm_route` takes (each program holds a row and
#: its experts' router rows in registers)
FUSED_ROUTE_MAX_COLS = 8192


class DenseOps:
    name = "base"

    def add_rms_norm(self, h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``h + delta`` (``h`` when ``delta`` is None) and its RMSNorm times ``weight``;
        ``[T, N]`` tensors in the activation dtype."""
        raise NotImplementedError

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, qk_weight: Optional[torch.Tensor], rotary: Rotary,
                           positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
        """Per-head RMSNorm (weights ``[D]``) and NeoX RoPE at ``positions`` of ``q``
        (``[T, Hq*D]``) and ``k`` (``[T, Hkv*D]``); k and ``v`` (``[T, Hkv*DV]``, ``DV`` the
        v cache's head size, which may differ from ``D``) are stored into their cache
        ``slots``. Returns q as ``[T, Hq, D]``. ``qk_weight`` (``[Hq+Hkv, D]``, or None) is
        the two weights stacked, for implementations that normalise q and k of one matmul
        output together."""
        raise NotImplementedError

    def router_top_k(self, logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` expert ids (int32 ``[T, k]``, descending logits) and their float32
        weights: the softmax over the top-k logits when ``norm``, else their probabilities
        under the softmax over every expert."""
        raise NotImplementedError

    def grouped_top_k(self, logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                      routing: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Expert ids (int32 ``[T, top_k]``) and float32 weights of the grouped routing of
        GLM-4.5 and DeepSeek (``routing``: a :class:`~freetoken.models.routing.GroupedTopK`;
        sigmoid scores with ``correction_bias``, or softmax scores without) from the router's
        float32 ``logits``. This implementation: the torch ops of
        :mod:`freetoken.models.routing` (the reference)."""
        from freetoken.models.routing import grouped_sigmoid_top_k, grouped_softmax_top_k

        if correction_bias is None:
            return grouped_softmax_top_k(logits, routing)
        return grouped_sigmoid_top_k(logits, correction_bias, routing)

    def add_norm_route(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, router: Any,
                       k: int, norm: bool) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        """:meth:`add_rms_norm` of ``h`` and ``delta`` followed by the router (``router(x)``,
        float32 logits) and :meth:`router_top_k`, where an implementation has them as one
        operation: ``(h + delta, x, ids, weights)``; None where it has not (the caller runs
        the three). This implementation: None."""
        return None

    def add_norm_grouped_route(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                               router: Any, correction_bias: Optional[torch.Tensor],
                               routing: Any) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        """:meth:`add_norm_route` with :meth:`grouped_top_k`'s choice instead of the softmax
        top-k: ``(h + delta, x, ids, weights)`` where an implementation has it as one
        operation; None where it has not. This implementation: None."""
        return None

    def bias_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rotary: Rotary,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Projection biases (float32 ``[Hq*D]``, ``[Hkv*D]``, ``[Hkv*D]``, or None) added to
        ``q`` (``[T, Hq*D]``), ``k`` and ``v`` (``[T, Hkv*D]``), NeoX RoPE of q and k (no
        norm), k and v stored into their cache ``slots``. Returns q as ``[T, Hq, D]``.
        ``cos``/``sin``: ``rotary.tables(positions, dtype)``, computed once per step.
        This implementation: plain torch ops (the reference; what the Triton ops use)."""
        from freetoken.models.attention import write_kv

        T = q.shape[0]
        _, _, Hkv, D = k_cache.shape
        if bias is not None:
            q, k, v = (t + b.to(t.dtype) for t, b in zip((q, k, v), bias))
        qh = rotary.apply(q.reshape(T, -1, D), cos, sin)
        kh = rotary.apply(k.reshape(T, Hkv, D), cos, sin)
        write_kv(k_cache, v_cache, kh, v.reshape(T, Hkv, D), slots)
        return qh

    def moe_bias_add(self, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                     hidden: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """``y[:, :hidden] + sum_k w[:, k] * bias[ids[:, k]]`` (float32 ``bias [E, hidden]``;
        the routed experts' down-projection biases) in float32, returned in ``dtype``.
        This implementation: plain torch ops (the reference; what the Triton ops use)."""
        return (y[:, :hidden].float() + (w.unsqueeze(-1) * bias[ids.long()]).sum(1)).to(dtype)

    def deltanet_decode(self, layer: Any, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One decode token of a Gated DeltaNet layer (``layer``: a
        :class:`freetoken.models.gated_deltanet.GatedDeltaNet`, which imports this module)
        per state slot between its projections:
        from the input projection's outputs (``mixed`` ``[T, conv channels]``, ``z``
        ``[T, Hv*dv]``, ``b`` and ``a`` ``[T, Hv]``) to the gated RMSNorm's output
        ``[T, Hv*dv]``, the layer's convolution windows and states (rows ``slots``) updated in
        place. This implementation: the layer's torch ops
        (:meth:`freetoken.models.gated_deltanet.GatedDeltaNet.decode_torch`)."""
        return layer.decode_torch(mixed, z, b, a, conv_state, ssm_state, slots)


class TorchDenseOps(DenseOps):
    name = "torch"

    def add_rms_norm(self, h, delta, weight, eps):
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)

    def qk_norm_rope_store(self, q, k, v, q_weight, k_weight, qk_weight, rotary, positions, k_cache, v_cache,
                           slots, eps):  # fmt: skip
        from freetoken.models.attention import write_kv

        T = q.shape[0]
        _, _, Hkv, D = k_cache.shape
        Hq = q.shape[1] // D
        cos, sin = rotary.tables(positions, q.dtype)
        adjacent = (qk_weight is not None and k.storage_offset() == q.storage_offset() + Hq * D
                    and q.stride() == k.stride() and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())
        if adjacent:  # q and k side by side in one matmul output: one norm and one rotation
            qk = q.as_strided((T, Hq + Hkv, D), (q.stride(0), D, 1))
            qk = rotary.apply(rms_norm_heads(qk, qk_weight, eps), cos, sin)
            qh, kh = qk[:, :Hq], qk[:, Hq:]
        else:
            qh = rotary.apply(rms_norm(q.reshape(T, Hq, D), q_weight, eps), cos, sin)
            kh = rotary.apply(rms_norm(k.reshape(T, Hkv, D), k_weight, eps), cos, sin)
        write_kv(k_cache, v_cache, kh, v.reshape(T, Hkv, v_cache.shape[3]), slots)
        return qh

    def router_top_k(self, logits, k, norm):
        if norm:
            # softmax over all experts then renormalised over the top-k == softmax of the top-k logits
            top, ids = torch.topk(logits, k, dim=-1)
            return ids.to(torch.int32), torch.softmax(top, dim=-1, dtype=torch.float32)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, k, dim=-1)
        return ids.to(torch.int32), w


class TritonDenseOps(DenseOps):
    name = "triton"

    def __init__(self, qk_norm_rope: bool = True) -> None:
        """``qk_norm_rope`` False: :meth:`qk_norm_rope_store` runs the torch ops (a head size
        the kernel does not take, decided when the model is built: :func:`dense_ops_for`)."""
        from freetoken.kernels import dense_ops as dense_kernels

        self.k = dense_kernels
        self.fused_qk_norm_rope = qk_norm_rope

    def add_rms_norm(self, h, delta, weight, eps):
        h = h.contiguous()
        x = torch.empty_like(h)
        if delta is None:
            self.k.add_rms_norm(h, None, weight, eps, h, x)
            return h, x
        h_new = torch.empty_like(h)
        self.k.add_rms_norm(h, delta.contiguous(), weight, eps, h_new, x)
        return h_new, x

    def qk_norm_rope_store(self, q, k, v, q_weight, k_weight, qk_weight, rotary, positions, k_cache, v_cache,
                           slots, eps):  # fmt: skip
        if not self.fused_qk_norm_rope:
            return TORCH_OPS.qk_norm_rope_store(q, k, v, q_weight, k_weight, qk_weight, rotary, positions, k_cache,
                                                v_cache, slots, eps)  # fmt: skip
        T = q.shape[0]
        D = k_cache.shape[3]
        Hq = q.shape[1] // D
        for t in (q, k, v):
            if t.stride(-1) != 1:
                raise ValueError("q, k and v need unit stride in their last dimension")
        q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
        self.k.qk_norm_rope(q, k, v, q_weight, k_weight, rotary.cos, rotary.sin_signed, positions, slots,
                            k_cache, v_cache, eps, q_out)  # fmt: skip
        return q_out

    def bias_rope_store(self, q, k, v, bias, rotary, cos, sin, positions, k_cache, v_cache, slots):
        """One launch (the tables read by position, as :meth:`qk_norm_rope_store`) where the
        head size is the fused kernel's; else the torch ops."""
        if not self.fused_qk_norm_rope or any(t.stride(-1) != 1 for t in (q, k, v)):
            return TORCH_OPS.bias_rope_store(q, k, v, bias, rotary, cos, sin, positions, k_cache, v_cache, slots)
        T, D = q.shape[0], k_cache.shape[3]
        q_out = torch.empty(T, q.shape[1] // D, D, dtype=q.dtype, device=q.device)
        self.k.bias_rope(q, k, v, bias, rotary.cos, rotary.sin_signed, positions, slots, k_cache, v_cache, q_out)
        return q_out

    def moe_bias_add(self, y, ids, w, bias, hidden, dtype):
        if y.stride(-1) != 1:
            return super().moe_bias_add(y, ids, w, bias, hidden, dtype)
        out = torch.empty(y.shape[0], hidden, dtype=dtype, device=y.device)
        self.k.moe_bias_add(y, ids.contiguous(), w.contiguous(), bias, out)
        return out

    def router_top_k(self, logits, k, norm):
        T = logits.shape[0]
        ids = torch.empty(T, k, dtype=torch.int32, device=logits.device)
        w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
        self.k.router_top_k(logits.contiguous(), k, norm, ids, w)
        return ids, w

    def grouped_top_k(self, logits, correction_bias, routing):
        """One launch (one program per token) where the experts fit a program
        (:data:`~freetoken.kernels.dense_ops.GROUPED_TOP_K_MAX_EXPERTS`), else the torch ops."""
        T, E = logits.shape
        if E > self.k.GROUPED_TOP_K_MAX_EXPERTS or logits.dtype != torch.float32:
            return super().grouped_top_k(logits, correction_bias, routing)
        ids = torch.empty(T, routing.top_k, dtype=torch.int32, device=logits.device)
        w = torch.empty(T, routing.top_k, dtype=torch.float32, device=logits.device)
        self.k.grouped_top_k(logits.contiguous(), correction_bias, routing.n_group, routing.topk_group, routing.top_k,
                             correction_bias is not None, routing.norm_topk_prob, routing.routed_scaling_factor,
                             ids, w)  # fmt: skip
        return ids, w

    def add_norm_route(self, h, delta, weight, eps, router, k, norm):
        """One launch for a decode step's few tokens with a router the fused routings take
        (:func:`_fused_router_weight`), or one with a float32 bias
        (:class:`~freetoken.models.layers.BiasedRouter`); else None."""
        from freetoken.models.layers import BiasedRouter

        bias = None
        if type(router) is BiasedRouter:
            router, bias = router.linear, router.bias
            if not _float32_on(bias, h.device):
                return None
        rw = _fused_router_weight(h, router)
        if rw is None:
            return None
        h, h_new, x, logits, ids, w, counts = _routing_outputs(h, rw.shape[0], k)
        self.k.add_norm_route(h, delta.contiguous(), weight, eps, rw, k, norm, h_new, x, logits, counts, ids, w,
                              bias=bias)  # fmt: skip
        return h_new, x, ids, w

    def add_norm_grouped_route(self, h, delta, weight, eps, router, correction_bias, routing):
        """One launch under :meth:`add_norm_route`'s conditions (no router bias) for at most
        :data:`~freetoken.kernels.dense_ops.GROUPED_TOP_K_MAX_EXPERTS` experts and a float32
        correction bias on the device; else None."""
        rw = _fused_router_weight(h, router)
        if rw is None or rw.shape[0] > self.k.GROUPED_TOP_K_MAX_EXPERTS:
            return None
        if correction_bias is not None and not _float32_on(correction_bias, h.device):
            return None
        h, h_new, x, logits, ids, w, counts = _routing_outputs(h, rw.shape[0], routing.top_k)
        self.k.add_norm_grouped_route(h, delta.contiguous(), weight, eps, rw, correction_bias, routing.n_group,
                                      routing.topk_group, routing.top_k, correction_bias is not None,
                                      routing.norm_topk_prob, routing.routed_scaling_factor, h_new, x, logits,
                                      counts, ids, w)  # fmt: skip
        return h_new, x, ids, w


def _fused_router_weight(h: torch.Tensor, router: Any) -> Optional[torch.Tensor]:
    """The float32 weight the fused decode routings read from ``router``: a contiguous
    :class:`~freetoken.models.layers.RouterLinear` on ``h``'s device, for at most
    ``RouterLinear.gemv_tokens`` tokens of rows of at most :data:`FUSED_ROUTE_MAX_COLS` values;
    else None."""
    from freetoken.models.layers import RouterLinear

    T, N = h.shape
    rw = getattr(router, "weight", None)
    if (type(router) is not RouterLinear or T > RouterLinear.gemv_tokens or N > FUSED_ROUTE_MAX_COLS
            or rw is None or not rw.is_contiguous() or rw.shape[1] != N or h.device != rw.device):
        return None
    return rw


def _float32_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device == device


def _routing_outputs(h: torch.Tensor, experts: int, k: int) -> tuple[torch.Tensor, ...]:
    """``h`` contiguous and the fused routings' outputs for it: ``h + delta``, ``x``, the float32
    logits ``[T, experts]``, int32 ids and float32 weights ``[T, k]``, and the zeroed counters."""
    from freetoken.kernels.counters import zeroed_counters

    T = h.shape[0]
    h = h.contiguous()
    return (h, torch.empty_like(h), torch.empty_like(h),
            torch.empty(T, experts, dtype=torch.float32, device=h.device),
            torch.empty(T, k, dtype=torch.int32, device=h.device), torch.empty(T, k, dtype=torch.float32, device=h.device),
            zeroed_counters("add_norm_route", h.device, T))  # fmt: skip


TORCH_OPS = TorchDenseOps()


@functools.lru_cache(maxsize=None)
def _triton_ops_for(device: torch.device) -> tuple[Optional[DenseOps], str]:
    from freetoken.backends import triton_target

    target = triton_target.for_device(device)
    if not target.usable:
        return None, target.reason
    import triton

    if triton.knobs.runtime.interpret:
        return None, "Triton's interpreter is on (TRITON_INTERPRET)"
    return TritonDenseOps(), target.reason


#: implementations installed by backends, by device type
_INSTALLED: dict[str, DenseOps] = {}


def use_dense_ops(device_type: str, ops: Optional[DenseOps]) -> Optional[DenseOps]:
    """Install ``ops`` for models built afterwards on devices of ``device_type`` (None: back
    to the default choice); returns what was installed before."""
    before = _INSTALLED.pop(device_type, None)
    if ops is not None:
        _INSTALLED[device_type] = ops
    return before


def dense_ops_for(device: torch.device, head_dim: Optional[int] = None,
                  v_head_dim: Optional[int] = None) -> DenseOps:  # fmt: skip
    """What a backend installed for the device type (:func:`use_dense_ops`), else fused Triton
    kernels on GPUs that run them, plain torch ops elsewhere. With the model's ``head_dim``
    (and ``v_head_dim``, default the same), a head size the fused q/k norm + RoPE kernel does
    not take (:func:`freetoken.kernels.availability.head_dim_support`) gives Triton ops whose
    q/k norm + RoPE runs the torch ops, logged once here: decided when the model is built,
    never a compiler error in a request."""
    device = torch.device(device)
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return TORCH_OPS
    installed = _INSTALLED.get(device.type)
    if installed is not None:
        return installed
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ops, why = _triton_ops_for(device)
    if ops is None:
        log.debug("dense ops on %s: torch (%s)", device, why)
        return TORCH_OPS
    if head_dim is not None:
        return _for_head_dim(ops, int(head_dim), None if v_head_dim is None else int(v_head_dim))
    return ops


@functools.lru_cache(maxsize=None)
def _for_head_dim(ops: DenseOps, head_dim: int, v_head_dim: Optional[int]) -> DenseOps:
    from freetoken.kernels.availability import head_dim_support

    support = head_dim_support(head_dim, v_head_dim)
    if support.qk_norm_rope:
        return ops
    log.warning("dense ops: q/k norm + RoPE in torch ops, not the Triton kernel: %s", support.qk_norm_rope_why)
    return TritonDenseOps(qk_norm_rope=False)
