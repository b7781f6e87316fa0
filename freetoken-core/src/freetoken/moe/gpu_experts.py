"""The GPU side of a hybrid MoE layer: routed experts resident on the GPU.

Experts are held as stacked BF16 (or FP16/FP32) tensors ``gate/up [E, I, H]`` and
``down [E, H, I]`` on the device. :meth:`GpuExperts.forward` computes
``y[t] = sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t)`` over the routes whose id is
``>= 0`` (``-1`` marks routes served by the CPU) with no host synchronisation, so it is
captured into decode graphs:

* few routes (decode): gather the routed experts' weights and run batched GEMVs
  (reads each routed expert once, like a fused MoE kernel);
* many routes (prefill): one dense pass per expert over all tokens, masked by routing.
"""

from __future__ import annotations

import math
from typing import Any, Optional

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


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


class GpuExperts:
    def __init__(self, gate: Any, up: Any, down: Any, activation: str = "silu") -> None:
        if gate.shape != up.shape or gate.dim() != 3 or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(
                f"expert shapes: gate/up must be [E, I, H] and down [E, H, I]; got gate {tuple(gate.shape)}, "
                f"up {tuple(up.shape)}, down {tuple(down.shape)}"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        self.gate, self.up, self.down = gate.contiguous(), up.contiguous(), down.contiguous()
        self.activation = activation
        self.num_experts, self.intermediate, self.hidden = gate.shape

    def forward(self, x: Any, gpu_ids: Any, w: Any, out: Optional[Any] = None) -> Any:
        """``x [T, H]`` (any float dtype), ``gpu_ids [T, K]`` (-1 = not on the GPU), ``w [T, K]``.
        Returns ``[T, H]`` in ``x.dtype`` (written into ``out`` when given)."""
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


def reference_experts(x: Any, ids: Any, w: Any, gate: Any, up: Any, down: Any, activation: str = "silu") -> Any:
    """Float64 per-route loop on the CPU (the independent reference for tests/qualification)."""
    import torch

    x64 = x.detach().cpu().double()
    g64, u64, d64 = (t.detach().cpu().double() for t in (gate, up, down))
    ids_c, w_c = ids.detach().cpu(), w.detach().cpu().double()
    y = torch.zeros(x64.shape[0], d64.shape[1], dtype=torch.float64)
    for t in range(x64.shape[0]):
        for k in range(ids_c.shape[1]):
            e = int(ids_c[t, k])
            if e < 0:
                continue
            h = _act(g64[e] @ x64[t], u64[e] @ x64[t], activation)
            y[t] += w_c[t, k] * (d64[e] @ h)
    return y


def random_experts(
    num_experts: int, hidden: int, intermediate: int, dtype: Any, device: Any = "cpu", generator: Any = None
) -> tuple[Any, Any, Any]:
    """Random expert weights scaled so activations stay O(1) (tests, qualification)."""
    import torch

    def mk(*shape: int, fan_in: int) -> Any:
        return (torch.randn(*shape, generator=generator) / math.sqrt(fan_in)).to(dtype).to(device)

    return (
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, hidden, intermediate, fan_in=intermediate),
    )
