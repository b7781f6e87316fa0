"""The GPU side of a hybrid MoE layer: routed experts resident on the GPU.

Experts are held as stacked BF16 (or FP16/FP32) tensors ``gate/up [E, I, H]`` and
``down [E, H, I]`` on the device. :meth:`GpuExperts.forward` computes
``y[t] = sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t)`` over the routes whose id is
``>= 0`` (``-1`` marks routes served by the CPU) with no host synchronisation, so it is
captured into decode graphs. Two implementations, chosen per instance (``impl``):

* ``triton`` (default where :mod:`freetoken.backends.triton_target` says Triton runs: NVIDIA
  GPUs of compute capability >= 8.0, AMD CDNA2-4 and RDNA3/4, triton importable):
  the fused kernels of :mod:`freetoken.kernels.moe_experts`, two launches (+ one cast when the
  activations are not float32), each distinct routed expert's weights read once;
* ``torch`` (the reference, and the fallback without Triton): few routes (decode) gather
  the routed experts' weights and run batched GEMVs; many routes (prefill) one dense pass
  per expert over all tokens, masked by routing.

Triton compiles a kernel variant on its first launch, which must not happen during stream
capture: run :meth:`GpuExperts.warmup` (or one eager forward with the same shapes) before
capturing. A capture that meets a variant not yet compiled computes with the torch
implementation instead (logged once; counted in ``capture_fallbacks``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from freetoken.kernels import availability
from freetoken.moe.experts.routed import GpuRoutedExperts

log = logging.getLogger(__name__)

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
IMPLS = ("triton", "torch")


def _act(gate: Any, up: Any, activation: str, alpha: float = 1.702, limit: float = 7.0) -> Any:
    import torch
    import torch.nn.functional as F

    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def _writable_output(out: Optional[Any], x: Any, tokens: int, hidden: int, dtypes: tuple[Any, ...]) -> bool:
    """``out`` can take the kernels' result as it is: contiguous ``[tokens, hidden]`` in one of
    ``dtypes`` on x's device, not aliasing x."""
    return (
        out is not None and out.dtype in dtypes and out.is_contiguous() and out.device == x.device
        and tuple(out.shape) == (tokens, hidden) and out.data_ptr() != x.data_ptr()
    )  # fmt: skip


def float32_output(out: Optional[Any], x: Any, tokens: int, hidden: int, device: Any) -> tuple[Any, bool]:
    """The float32 ``[tokens, hidden]`` buffer the kernels accumulate into: ``out`` itself
    when it qualifies (contiguous float32 of that shape on x's device, not aliasing x),
    else a new tensor; and whether it is ``out``."""
    import torch

    direct = _writable_output(out, x, tokens, hidden, (torch.float32,))
    return (out if direct else torch.empty(tokens, hidden, dtype=torch.float32, device=device)), direct


def stored_output(out: Optional[Any], x: Any, tokens: int, hidden: int, device: Any) -> tuple[Any, bool]:
    """The ``[tokens, hidden]`` buffer of kernels that sum in float32 and store each value
    once, in float32, bfloat16 or float16: ``out`` itself when it qualifies (contiguous, one
    of those dtypes, that shape, on x's device, not aliasing x), else a new tensor in x's
    dtype (float32 for other dtypes), so that no conversion follows; and whether it is ``out``."""
    import torch

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if _writable_output(out, x, tokens, hidden, dtypes):
        return out, True
    return torch.empty(tokens, hidden, dtype=x.dtype if x.dtype in dtypes else torch.float32, device=device), False


def finish_output(y: Any, out: Optional[Any], direct: bool, x_dtype: Any) -> Any:
    """The experts' result from the buffer ``y``: in ``out`` when given, else in ``x_dtype``."""
    if direct:
        return out
    if out is not None:
        out.copy_(y)
        return out
    return y if y.dtype == x_dtype else y.to(x_dtype)


class GpuExperts(GpuRoutedExperts):
    def __init__(
        self, gate: Any, up: Any, down: Any, activation: str = "silu", impl: Optional[str] = None,
        block_config: Any = None,
    ) -> None:  # fmt: skip
        if gate.shape != up.shape or gate.dim() != 3 or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(
                f"expert shapes: gate/up must be [E, I, H] and down [E, H, I]; got gate {tuple(gate.shape)}, "
                f"up {tuple(up.shape)}, down {tuple(down.shape)}"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        if gate.dtype != up.dtype or gate.dtype != down.dtype:
            raise ValueError(f"expert dtypes differ: gate {gate.dtype}, up {up.dtype}, down {down.dtype}")
        self.gate, self.up, self.down = gate.contiguous(), up.contiguous(), down.contiguous()
        self.activation = activation
        self.num_experts, self.intermediate, self.hidden = gate.shape
        self.auto = impl in (None, "auto")
        if self.auto:
            impl, why = availability.default_impl(gate.device)
            log.debug("GPU experts on %s: %s implementation (%s)", gate.device, impl, why)
        elif impl not in IMPLS:
            raise ValueError(f"unknown GPU experts implementation {impl!r}; expected one of {IMPLS}")
        elif impl == "triton":
            availability.check_triton(gate.device)
        self.impl = impl
        if block_config is not None:
            block_config.validate()
        self.block_config = block_config
        self.capture_fallbacks = 0
        self.fallback_reason: Optional[str] = None  # why an automatic Triton choice fell back to torch
        self._compiled: set[tuple[Any, ...]] = set()

    def forward(self, x: Any, gpu_ids: Any, w: Any, out: Optional[Any] = None) -> Any:
        """``x [T, H]`` (any float dtype), ``gpu_ids [T, K]`` (-1 = not on the GPU), ``w [T, K]``.
        Returns ``[T, H]`` in ``x.dtype`` (written into ``out`` when given)."""
        if self.impl == "triton":
            return self._forward_triton(x, gpu_ids, w, out)
        return self._forward_torch(x, gpu_ids, w, out)

    def warmup(
        self, batch_sizes: Iterable[int], top_k: int, x_dtype: Any = None, ids_dtype: Any = None, w_dtype: Any = None
    ) -> None:
        """Compile the Triton variants these shapes use (eagerly, on random inputs) so that
        a later stream capture finds them; defaults: weights' dtype, int32 ids, float32 weights."""
        import torch

        if self.impl != "triton":
            return
        dev = self.gate.device
        x_dtype = x_dtype or self.gate.dtype
        for tokens in batch_sizes:
            x = torch.randn(tokens, self.hidden, device=dev).to(x_dtype)
            ids = torch.randint(-1, self.num_experts, (tokens, top_k), device=dev).to(ids_dtype or torch.int32)
            w = torch.rand(tokens, top_k, device=dev).to(w_dtype or torch.float32)
            self.forward(x, ids, w)

    # ---- Triton --------------------------------------------------------------------------
    def _forward_triton(self, x: Any, gpu_ids: Any, w: Any, out: Optional[Any]) -> Any:
        import torch

        from freetoken.kernels import moe_experts


        from freetoken.kernels import moe_grouped

        tokens, top_k = gpu_ids.shape
        x, ids, w = x.contiguous(), gpu_ids.contiguous(), w.contiguous()
        dev = self.gate.device
        y, direct = float32_output(out, x, tokens, self.hidden, dev)
        config = self.block_config or moe_experts.DEFAULT_CONFIG
        grouped = tokens * top_k > moe_grouped.MIN_ROUTES and self.gate.dtype == torch.bfloat16
        key = moe_grouped.variant_key(x, ids, w) if grouped else moe_experts.variant_key(x, ids, w, y, config)
        if key not in self._compiled and x.is_cuda and torch.cuda.is_current_stream_capturing():
            if not self.capture_fallbacks:
                log.warning(
                    "GPU experts: Triton variant for %d tokens x %d routes (%s) not compiled before stream capture; "
                    "this graph uses the torch implementation (call GpuExperts.warmup before capture)",
                    tokens, top_k, x.dtype,
                )  # fmt: skip
            self.capture_fallbacks += 1
            return self._forward_torch(x, gpu_ids, w, out)
        try:
            if grouped:
                moe_grouped.launch(x, ids, w, self.gate, self.up, self.down, y, self.activation)
            else:
                h = torch.empty(tokens, top_k, self.intermediate, dtype=self.gate.dtype, device=dev)
                moe_experts.launch(x, ids, w, self.gate, self.up, self.down, y, h, self.activation, config)
        except Exception as exc:  # noqa: BLE001 - compilation or launch; only an automatic choice falls back
            if not self.auto:
                raise
            self.impl, self.fallback_reason = "torch", f"{type(exc).__name__}: {exc}"
            log.error("GPU experts: the Triton kernels failed (%s); using torch instead", self.fallback_reason)
            return self._forward_torch(x, gpu_ids, w, out)
        self._compiled.add(key)
        return finish_output(y, out, direct, x.dtype)

    # ---- torch (reference implementation) -----------------------------------------------
    def _forward_torch(self, x: Any, gpu_ids: Any, w: Any, out: Optional[Any]) -> Any:
        import torch

        tokens, top_k = gpu_ids.shape
        wdt = self.gate.dtype
        valid = gpu_ids >= 0
        weights = torch.where(valid, w.float(), torch.zeros_like(w, dtype=torch.float32))
        if tokens * top_k <= self.num_experts:
            eid = gpu_ids.clamp(min=0).long().reshape(-1)
            xs = x.to(wdt).repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [R, H, 1]
            g = torch.bmm(self.gate.index_select(0, eid), xs).squeeze(-1)  # [R, I]
            u = torch.bmm(self.up.index_select(0, eid), xs).squeeze(-1)
            h = _act(g.float(), u.float(), self.activation).to(wdt).unsqueeze(-1)
            d = torch.bmm(self.down.index_select(0, eid), h).squeeze(-1).float()  # [R, H]
            y = (d.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
        else:
            xw = x.to(wdt)
            y = torch.zeros(tokens, self.hidden, dtype=torch.float32, device=x.device)
            for e in range(self.num_experts):
                coef = (weights * (gpu_ids == e)).sum(dim=1, keepdim=True)  # [T, 1]
                g = xw @ self.gate[e].t()
                u = xw @ self.up[e].t()
                h = _act(g.float(), u.float(), self.activation).to(wdt)
                y += coef * (h @ self.down[e].t()).float()
        if out is None:
            return y.to(x.dtype)
        out.copy_(y)
        return out

