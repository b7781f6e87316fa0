"""Fused MoE for the GPU side of a hybrid layer: two Triton kernels over resident experts.

For small decode batches (T = 1..64 tokens, top-k routes, ids ``-1`` skipped) the work is
memory-bound: every distinct routed expert's weights must be read once. Both kernels run
one program per (expert, output tile, token tile); a program whose expert no token of its
tile routes to does nothing beyond reading the tile's ids, so the weights read are those
of the distinct routed experts, each once per token tile::

    gate_up  grid (E, cdiv(I, BLOCK_I), cdiv(T, BLOCK_T)):
             h[t, slot_e(t), i] = act(x_t . gate_e[i, :], x_t . up_e[i, :])   (fp32 acc,
             stored in the weights' dtype); programs of expert 0 also zero ``y``
    down     grid (E, cdiv(H, BLOCK_N), cdiv(T, BLOCK_T)):
             y[t, n] += (sum_k w[t, k] [ids[t, k] == e]) * (h[t, slot_e(t), :] . down_e[n, :])
             (fp32 atomic adds; the routing weight multiply and the top-k reduction)

For the smallest batches (``T * K <= route_kernels_max_routes``) most of those programs
would find no token of theirs: two per-route kernels run instead, with no idle program and
no atomics::

    gate_up_routes  grid (T*K, cdiv(I, ROUTE_BLOCK_I)): route r = (t, k) of expert ids[t, k]:
                    h[t, k, i] = act(x_t . gate_e[i, :], x_t . up_e[i, :])
    down_routes     grid (T, cdiv(H, ROUTE_BLOCK_N)):
                    y[t, n] = sum_k w[t, k] * (h[t, k, :] . down_{ids[t, k]}[n, :])

(a route whose id is ``-1`` is skipped; weights are read once per route, which equals once
per distinct expert when the batch's tokens share none, the common case at small ``T``).

``slot_e(t)`` is the first k with ``ids[t, k] == e``: a token routing twice to one expert
gets one ``h`` and the sum of both weights, which is the same sum. Tokens are padded to a
block of at least 16 rows (``tl.dot`` needs M, N, K >= 16) and masked.

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import triton
import triton.language as tl

from freetoken.backends import triton_target

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes. ``block_t`` None: the token count rounded up to a power of two in 16..64."""

    block_i: int = 16  # gate_up: intermediate rows per program
    block_h: int = 128  # gate_up: reduction step over hidden
    block_n: int = 32  # down: hidden rows per program
    block_r: int = 128  # down: reduction step over intermediate
    block_t: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 3
    #: batches of at most this many routes (T * K) run the per-route kernels (0: never)
    route_kernels_max_routes: int = 32
    route_block_i: int = 8  # gate_up_routes: intermediate rows per program
    route_block_h: int = 256  # gate_up_routes: reduction step over hidden
    route_block_n: int = 8  # down_routes: hidden rows per program
    route_block_r: int = 256  # down_routes: reduction step over intermediate

    def per_route(self, tokens: int, top_k: int) -> bool:
        return tokens * top_k <= self.route_kernels_max_routes

    def tokens_block(self, tokens: int) -> int:
        if self.block_t is not None:
            return self.block_t
        return min(64, max(16, triton.next_power_of_2(tokens)))

    def validate(self) -> None:
        for name in ("block_i", "block_h", "block_n", "block_r"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 16 (tl.dot)")
        if self.block_t is not None and (self.block_t < 16 or self.block_t & (self.block_t - 1)):
            raise ValueError(f"block_t={self.block_t}: must be a power of two >= 16 (tl.dot)")


DEFAULT_CONFIG = BlockConfig()
ACT_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}
# gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g sigmoid(2 c (g + 0.044715 g^3)), c = sqrt(2/pi)
GELU_2C = tl.constexpr(2.0 * 0.7978845608028654)


@triton.jit
def activate(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gated activation of gate ``g`` and up ``u`` (float32), by :data:`ACT_CODES`."""
    if ACT == 0:  # silu
        return g * tl.sigmoid(g) * u
    elif ACT == 1:  # gelu (tanh approximation)
        return g * tl.sigmoid(GELU_2C * (g + 0.044715 * g * g * g)) * u
    else:  # swiglu_oai: clamped gate and up, up + 1
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        return gc * tl.sigmoid(ALPHA * gc) * (uc + 1.0)


@triton.jit(do_not_specialize=["T", "K"])
def _gate_up_kernel(
    x_ptr, ids_ptr, gate_ptr, up_ptr, h_ptr, y_ptr,
    T, K,
    H: tl.constexpr, I: tl.constexpr, ZERO_COLS: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    pid_e = tl.program_id(0)
    pid_i = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T

    if pid_e == 0:  # zero this token tile's output; the down kernel accumulates into it
        for c in range(0, ZERO_COLS, BLOCK_H):  # this program's ZERO_COLS columns
            offs_c = pid_i * ZERO_COLS + c + tl.arange(0, BLOCK_H)
            zero = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            tl.store(y_ptr + offs_t[:, None] * H + offs_c[None, :], zero, mask=t_ok[:, None] & (offs_c[None, :] < H))

    route_ok = t_ok[:, None] & (offs_k[None, :] < K)
    ids = tl.load(ids_ptr + offs_t[:, None] * K + offs_k[None, :], mask=route_ok, other=-1)
    hit = (ids == pid_e) & route_ok
    if tl.sum(hit.to(tl.int32)) > 0:
        tok = tl.max(hit.to(tl.int32), axis=1) > 0  # [BLOCK_T]: the token routes to this expert
        slot = tl.min(tl.where(hit, offs_k[None, :], BLOCK_K), axis=1)  # its first such route
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        w_base = pid_e.to(tl.int64) * I * H
        acc_g = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            w_off = w_base + offs_i[:, None] * H + offs_h[None, :]
            w_mask = i_ok[:, None] & h_ok[None, :]
            g = tl.load(gate_ptr + w_off, mask=w_mask, other=0.0)  # [BLOCK_I, BLOCK_H]
            u = tl.load(up_ptr + w_off, mask=w_mask, other=0.0)
            xt = tl.load(x_ptr + offs_t[:, None] * H + offs_h[None, :], mask=tok[:, None] & h_ok[None, :], other=0.0)
            xt = xt.to(g.dtype)
            acc_g = tl.dot(xt, tl.trans(g), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, tl.trans(u), acc_u, input_precision=PRECISION)
        act = activate(acc_g, acc_u, ACT, ALPHA, LIMIT)
        h_off = (offs_t * K + slot)[:, None] * I + offs_i[None, :]
        tl.store(h_ptr + h_off, act.to(h_ptr.dtype.element_ty), mask=tok[:, None] & i_ok[None, :])


@triton.jit(do_not_specialize=["T", "K"])
def _down_kernel(
    h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr,
    T, K,
    H: tl.constexpr, I: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    route_ok = t_ok[:, None] & (offs_k[None, :] < K)
    r_off = offs_t[:, None] * K + offs_k[None, :]
    ids = tl.load(ids_ptr + r_off, mask=route_ok, other=-1)
    hit = (ids == pid_e) & route_ok
    if tl.sum(hit.to(tl.int32)) > 0:
        tok = tl.max(hit.to(tl.int32), axis=1) > 0
        slot = tl.min(tl.where(hit, offs_k[None, :], BLOCK_K), axis=1)
        rw = tl.load(w_ptr + r_off, mask=hit, other=0.0).to(tl.float32)
        coef = tl.sum(tl.where(hit, rw, 0.0), axis=1)  # [BLOCK_T]: summed weights of its routes to e
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        d_base = pid_e.to(tl.int64) * H * I
        h_row = (offs_t * K + slot) * I
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, I, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < I
            d = tl.load(down_ptr + d_base + offs_n[:, None] * I + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                        other=0.0)  # fmt: skip
            hv = tl.load(h_ptr + h_row[:, None] + offs_r[None, :], mask=tok[:, None] & r_ok[None, :], other=0.0)
            hv = hv.to(d.dtype)
            acc = tl.dot(hv, tl.trans(d), acc, input_precision=PRECISION)
        acc = acc * coef[:, None]
        y_off = offs_t[:, None] * H + offs_n[None, :]
        tl.atomic_add(y_ptr + y_off, acc, mask=tok[:, None] & n_ok[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["T"])
def _gate_up_routes_kernel(
    x_ptr, ids_ptr, gate_ptr, up_ptr, h_ptr,
    T, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    pid_i = tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64)
    if e >= 0:
        t = r // K
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        w_base = e * I * H
        acc_g = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            w_off = w_base + offs_i[:, None] * H + offs_h[None, :]
            w_mask = i_ok[:, None] & h_ok[None, :]
            xt = tl.load(x_ptr + t * H + offs_h, mask=h_ok, other=0.0)
            # the activation in the weights' dtype, as the MMA kernels multiply it
            xt = xt.to(gate_ptr.dtype.element_ty).to(tl.float32)
            g = tl.load(gate_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + w_off, mask=w_mask, other=0.0).to(tl.float32)
            acc_g += g * xt[None, :]
            acc_u += u * xt[None, :]
        gs = tl.sum(acc_g, axis=1)
        us = tl.sum(acc_u, axis=1)
        act = activate(gs, us, ACT, ALPHA, LIMIT)
        tl.store(h_ptr + r.to(tl.int64) * I + offs_i, act.to(h_ptr.dtype.element_ty), mask=i_ok)


@triton.jit(do_not_specialize=["T"])
def _down_routes_kernel(
    h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr,
    T, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    # every route's loads are independent (no branch per route: a skipped route's loads are
    # masked off, its weight is 0), so they can all be in flight at once
    for k in tl.static_range(K):
        e = tl.load(ids_ptr + t * K + k).to(tl.int64)
        ok = e >= 0
        wk = tl.where(ok, tl.load(w_ptr + t * K + k).to(tl.float32), 0.0)
        d_base = tl.maximum(e, 0) * H * I
        h_row = (t * K + k) * I
        for r0 in tl.static_range(0, I, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = (offs_r < I) & ok
            d = tl.load(down_ptr + d_base + offs_n[:, None] * I + offs_r[None, :],
                        mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            hv = tl.load(h_ptr + h_row + offs_r, mask=r_ok, other=0.0).to(tl.float32)
            acc += d * (hv * wk)[None, :]
    tl.store(y_ptr + t * H + offs_n, tl.sum(acc, axis=1), mask=n_ok)


def _tokens_and_routes_blocks(tokens: int, top_k: int, config: BlockConfig) -> tuple[int, int]:
    return config.tokens_block(tokens), max(2, triton.next_power_of_2(top_k))


def variant_key(x: Any, ids: Any, w: Any, y: Any, config: BlockConfig = DEFAULT_CONFIG) -> tuple[Any, ...]:
    """What selects the compiled variant of a launch beyond the experts' fixed shapes and
    dtype: constexpr blocks, argument dtypes and 16-byte pointer alignment (the token and
    route counts themselves are not specialised). Equal keys: no new compilation."""
    blocks = _tokens_and_routes_blocks(ids.shape[0], ids.shape[1], config)
    per_route = config.per_route(ids.shape[0], ids.shape[1])
    return (config, *blocks, per_route, ids.shape[1] if per_route else None, x.dtype, ids.dtype, w.dtype,
            tuple(t.data_ptr() % 16 == 0 for t in (x, ids, w, y)))


def launch(
    x: Any, ids: Any, w: Any, gate: Any, up: Any, down: Any, y: Any, h: Any, activation: str,
    config: BlockConfig = DEFAULT_CONFIG, alpha: float = 1.702, limit: float = 7.0,
) -> None:  # fmt: skip
    """``y [T, H]`` float32 (contiguous, overwritten) = the routed experts' output.

    ``x [T, H]``, ``ids [T, K]`` (int32/int64, -1 = skip), ``w [T, K]`` contiguous;
    ``gate/up [E, I, H]``, ``down [E, H, I]`` contiguous in one dtype; ``h [T, K, I]``
    scratch in the weights' dtype (contents need not be initialised)."""
    import torch

    tokens, top_k = ids.shape
    num_experts, inter, hidden = gate.shape
    if y.dtype != torch.float32 or not y.is_contiguous() or tuple(y.shape) != (tokens, hidden):
        raise ValueError(f"y must be a contiguous float32 [{tokens}, {hidden}] tensor, got {y.dtype} {tuple(y.shape)}")
    if tokens == 0:
        return
    if config.per_route(tokens, top_k):
        if not (ids.is_contiguous() and w.is_contiguous() and x.is_contiguous()):
            raise ValueError("x, ids and w must be contiguous")
        opts = triton_target.for_device(x.device).launch_options(config.num_warps, config.num_stages)
        _gate_up_routes_kernel[(tokens * top_k, triton.cdiv(inter, config.route_block_i))](
            x, ids, gate, up, h, tokens, K=top_k, H=hidden, I=inter,
            ACT=ACT_CODES[activation], ALPHA=float(alpha), LIMIT=float(limit),
            BLOCK_I=config.route_block_i, BLOCK_H=config.route_block_h, **opts,
        )  # fmt: skip
        _down_routes_kernel[(tokens, triton.cdiv(hidden, config.route_block_n))](
            h, ids, w, down, y, tokens, K=top_k, H=hidden, I=inter,
            BLOCK_N=config.route_block_n, BLOCK_R=config.route_block_r, **opts,
        )  # fmt: skip
        return
    block_t, block_k = _tokens_and_routes_blocks(tokens, top_k, config)
    t_tiles = triton.cdiv(tokens, block_t)
    i_tiles = triton.cdiv(inter, config.block_i)
    zero_cols = triton.cdiv(triton.cdiv(hidden, i_tiles), config.block_h) * config.block_h
    target = triton_target.for_device(x.device)
    precision = target.dot_precision(gate.dtype == torch.float32)
    opts = target.launch_options(config.num_warps, config.num_stages)
    _gate_up_kernel[(num_experts, i_tiles, t_tiles)](
        x, ids, gate, up, h, y, tokens, top_k, H=hidden, I=inter, ZERO_COLS=zero_cols,
        ACT=ACT_CODES[activation], ALPHA=float(alpha), LIMIT=float(limit), PRECISION=precision,
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_I=config.block_i, BLOCK_H=config.block_h, **opts,
    )  # fmt: skip
    _down_kernel[(num_experts, triton.cdiv(hidden, config.block_n), t_tiles)](
        h, ids, w, down, y, tokens, top_k, H=hidden, I=inter,
        PRECISION=precision,
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_N=config.block_n, BLOCK_R=config.block_r, **opts,
    )  # fmt: skip
