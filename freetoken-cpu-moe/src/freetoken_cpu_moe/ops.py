"""The functional API: one MoE layer, a dense projection, one hand-off task."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.arrays import (
    act_fmt_of,
    address_of,
    as_activation,
    as_float32,
    as_int32,
    empty_like_kind,
    out_fmt,
)
from freetoken_cpu_moe.pool import Pool, default_pool
from freetoken_cpu_moe.weights import ExpertBank, Weights

log = logging.getLogger(__name__)

#: environment variable read once at start-up: the highest kernel tier to use (a cap: tiers
#: above it are left out of :func:`isa_tiers`, as on a processor without them)
ISA_ENV = "FREETOKEN_CPU_MOE_ISA"


def isa_tiers() -> list[str]:
    """Kernel tiers this CPU supports, best first (e.g. ``["avx512", "avx_vnni", "avx2", "scalar"]``);
    with ``FREETOKEN_CPU_MOE_ISA`` set, only those at or below that tier."""
    return list(_core.isa_tiers())


def active_isa() -> str:
    """The tier in use: the best of :func:`isa_tiers` unless :func:`set_isa` chose another."""
    return str(_core.active_isa())


def set_isa(tier: str) -> None:
    """Use a tier for every later call (must be in :func:`isa_tiers`)."""
    _core.set_isa(tier)


#: every tier, best first (the order FREETOKEN_CPU_MOE_ISA caps by; csrc/dispatch.cpp)
TIER_ORDER: tuple[str, ...] = tuple(_core.tier_order())


def _check_env_isa() -> None:
    want = os.environ.get(ISA_ENV)
    if not want:
        return
    if want not in TIER_ORDER:
        log.warning("%s=%s is not a kernel tier (%s): nothing is capped; using %s", ISA_ENV, want,
                    ", ".join(TIER_ORDER), active_isa())
    elif want != active_isa():
        log.warning("%s=%s: this CPU has no %s tier; using %s", ISA_ENV, want, want, active_isa())


def _pool(pool: Optional[Pool]) -> Any:
    return (pool or default_pool())._core


def moe_forward(
    bank: ExpertBank,
    x: Any,
    ids: Any,
    w: Any,
    out_dtype: Any = None,
    pool: Optional[Pool] = None,
    *,
    out: Any = None,
    accumulate: bool = False,
    isa: Optional[str] = None,
) -> Any:
    """One MoE layer for T tokens: ``y[t] = sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t)``.

    ``x`` [T, H] float32/float16/bfloat16 (torch CPU tensor or numpy); ``ids`` int
    [T, K] (``-1`` = route served elsewhere, duplicates allowed); ``w`` float32 [T, K].
    Returns ``y`` [T, H] of x's kind, dtype x's unless ``out_dtype`` is given.
    Extras: ``out`` (write into this contiguous array; with ``accumulate=True``
    add to it) and ``isa`` (run a specific tier, e.g. for tests).
    """
    if not isinstance(bank, ExpertBank):
        raise TypeError(f"moe_forward: bank must be an ExpertBank, got {type(bank).__name__}")
    x = as_activation(x, "moe_forward: x")
    T, H = (int(s) for s in x.shape)
    if H != bank.hidden:
        raise ValueError(f"moe_forward: x has hidden size {H}, the bank has {bank.hidden}")
    ids32 = as_int32(ids, "moe_forward: ids")
    w32 = as_float32(w, "moe_forward: w")
    if ids32.ndim != 2 or ids32.shape[0] != T or w32.shape != ids32.shape:
        raise ValueError(
            f"moe_forward: ids {tuple(ids32.shape)} and w {tuple(w32.shape)} must both be [T={T}, K]"
        )
    x_fmt = act_fmt_of(x, "moe_forward: x")
    y, y_fmt = _output(x, (T, H), out_dtype, x_fmt, out, accumulate, "moe_forward")
    _core.moe_forward(
        bank.address, address_of(x), x_fmt, address_of(ids32), address_of(w32), address_of(y), y_fmt,
        T, int(ids32.shape[1]), bool(accumulate), _pool(pool), isa or "",
    )
    return y


def linear(
    weights: Weights,
    x: Any,
    out_dtype: Any = None,
    pool: Optional[Pool] = None,
    *,
    out: Any = None,
    accumulate: bool = False,
    isa: Optional[str] = None,
) -> Any:
    """Dense projection with a one-expert :class:`Weights`: x [T, cols] -> y [T, rows].

    Any weight format; a 1-D ``x`` [cols] gives a 1-D ``y`` [rows].
    """
    if not isinstance(weights, Weights):
        raise TypeError(f"linear: weights must be a Weights, got {type(weights).__name__}")
    if weights.num_experts != 1:
        raise ValueError(f"linear: weights must hold one matrix (num_experts=1), got {weights.num_experts}")
    squeeze = getattr(x, "ndim", 2) == 1
    if squeeze:
        x = x[None, :] if not hasattr(x, "unsqueeze") else x.unsqueeze(0)
    x = as_activation(x, "linear: x")
    T, C = (int(s) for s in x.shape)
    if C != weights.cols:
        raise ValueError(f"linear: x has {C} columns, the weights have {weights.cols}")
    x_fmt = act_fmt_of(x, "linear: x")
    if squeeze and out is not None:
        out = out[None, :] if not hasattr(out, "unsqueeze") else out.unsqueeze(0)
    y, y_fmt = _output(x, (T, weights.rows), out_dtype, x_fmt, out, accumulate, "linear")
    _core.linear(
        weights.address, address_of(x), x_fmt, T, address_of(y), y_fmt, bool(accumulate), _pool(pool), isa or ""
    )
    return y[0] if squeeze else y


def run_task(desc_address: int, pool: Optional[Pool] = None, *, isa: Optional[str] = None) -> None:
    """Run the ``ft_task_desc`` at ``desc_address`` now, on this thread and the pool.

    Bank from ``desc.bank``, T = ``desc.num_tokens``; writes y (adds to it with
    ``FT_TASK_ACCUMULATE``). Raises ValueError on a bad descriptor. The flag slot
    is not touched. This is the CPU backend's path and the numerical oracle of the
    GPU startup check.
    """
    _core.run_task(int(desc_address), _pool(pool), isa or "")


def _output(x: Any, shape: tuple[int, ...], out_dtype: Any, x_fmt: int, out: Any, accumulate: bool, who: str) -> tuple[Any, int]:
    if out is None:
        if accumulate:
            raise ValueError(f"{who}: accumulate=True needs out=")
        y_fmt = out_fmt(out_dtype, x_fmt)
        return empty_like_kind(x, shape, y_fmt), y_fmt
    if getattr(getattr(out, "device", None), "type", "cpu") != "cpu":
        raise ValueError(f"{who}: out must be a CPU array")
    y_fmt = act_fmt_of(out, f"{who}: out")
    if out_dtype is not None and out_fmt(out_dtype, x_fmt) != y_fmt:
        raise ValueError(f"{who}: out has dtype {out.dtype}, out_dtype says {out_dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{who}: out has shape {tuple(out.shape)}, expected {shape}")
    contiguous = out.is_contiguous() if hasattr(out, "is_contiguous") else out.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"{who}: out must be contiguous")
    return out, y_fmt
