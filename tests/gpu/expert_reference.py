"""Independent reference for the GPU expert tests: random expert weights and a float64
per-route loop on the CPU that the implementations of ``GpuExperts`` are compared with."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> Any:
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    raise ValueError(f"unknown activation {activation!r}")


def int8_groups(v: torch.Tensor, group: int = 32, fused: Optional[bool] = None) -> torch.Tensor:
    """``v`` (last dimension a multiple of ``group``) as int8 dots quantize activations, in
    float64: per ``group`` values ``floor(v * (127 / amax) + 1/2) * (amax / 127)``, the
    arithmetic float32. ``fused``: ``v * inv + 1/2`` rounded once (the compiled kernels' fma;
    the product is exact in float64) rather than the product and the sum each (Triton's
    interpreter); default: fused unless ``TRITON_INTERPRET=1``."""
    if fused is None:
        fused = os.environ.get("TRITON_INTERPRET", "0") != "1"
    g = v.detach().cpu().float().reshape(*v.shape[:-1], -1, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    # a tensor divided by a tensor: correctly rounded, as the kernels' division (torch computes a
    # scalar divided by a tensor through the reciprocal, an ulp off at times, and BF16
    # activations make exact ties of v * 127 / amax, which such a factor rounds the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-30), torch.zeros_like(amax))
    t = (g.double() * inv.double() + 0.5).float() if fused else g * inv + 0.5
    return (torch.floor(t) * (amax / 127.0)).reshape(v.shape).double()


def reference_experts(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
    activation: str = "silu", int8_x: bool = False, int8_h: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t)`` over routes with id >= 0, in
    float64 on the CPU, one route at a time; ``[T, H]`` float64. ``int8_x``: the tokens
    quantized by :func:`int8_groups` before their products; ``int8_h``: each route's ``h``
    (rounded to float32 first, as the kernels keep it) quantized per that many values."""
    x64 = int8_groups(x) if int8_x else x.detach().cpu().double()
    g64, u64, d64 = (t.detach().cpu().double() for t in (gate, up, down))
    ids_c, w_c = ids.detach().cpu(), w.detach().cpu().double()
    y = torch.zeros(x64.shape[0], d64.shape[1], dtype=torch.float64)
    for t in range(x64.shape[0]):
        for k in range(ids_c.shape[1]):
            e = int(ids_c[t, k])
            if e < 0:
                continue
            h = _activate(g64[e] @ x64[t], u64[e] @ x64[t], activation)
            if int8_h:
                h = int8_groups(h.float(), int8_h)
            y[t] += w_c[t, k] * (d64[e] @ h)
    return y


def random_experts(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: Any = "cpu",
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random ``gate/up [E, I, H]`` and ``down [E, H, I]`` scaled so activations stay O(1)."""

    def mk(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) / math.sqrt(fan_in)).to(dtype).to(device)

    return (
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, hidden, intermediate, fan_in=intermediate),
    )
