"""Fused MoE for prompt-sized batches: routes grouped by expert, each expert's weights read
once per block of routes.

The per-route kernels (:mod:`freetoken.kernels.moe_packed`) read an expert's weights
once per route, which is right for a decode step (a handful of routes, rarely two on one
expert) and ruinous for a prompt: 512 tokens x 8 routes over 128 experts read every expert
about 32 times. Here the routes are first sorted by expert (:func:`group_routes`, device
tensor ops, no host synchronisation) into blocks of ``BLOCK_M`` routes of one expert, each
expert's run padded to whole blocks. Two kernels then run one program per (block, output
tile) as a matrix product of the block's gathered rows with the expert's weight tile::

    gate_up  grid (blocks, cdiv(I, BLOCK_N)):
             h[r, i] = act(x_t(r) . gate_e[i, :], x_t(r) . up_e[i, :])   r in the block
    down     grid (blocks, cdiv(H, BLOCK_N)):
             y_routes[r, n] = w[r] * (h[r, :] . down_e[n, :])
    y[t] = sum_k y_routes[t * K + k]                                        (torch)

Weights are either the file's blocks (Q4_K, Q5_K, Q6_K, Q8_0: dequantized in registers by
:func:`freetoken.kernels.moe_packed.dequant_tile`, so the values equal gguf-py's) or a
plain 16/32-bit tensor (format code :data:`PLAIN`). The products run on the tensor cores in
BF16 (the weight tile rounded to BF16 as the dequantize-to-BF16 path rounds it), with
float32 accumulation; ``h`` is kept in BF16. A route with id ``-1`` contributes nothing.

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import triton
import triton.language as tl

from freetoken.backends import triton_target
from freetoken.kernels.moe_experts import ACT_CODES, activate
from freetoken.kernels.moe_packed import PackedStack, dequant_tile

#: format code of a plain (BF16) weight tensor
PLAIN = 0

#: batches of more routes than this take the grouped kernels (fewer: the per-route or tiled
#: kernels, which read a weight tile once per route or token tile but need no sorting)
MIN_ROUTES = 256

#: tokens per launch of the kernels: larger batches run in chunks, which bounds the
#: temporaries (h in BF16 and the per-route float32 outputs: ~70 MB at 1024 tokens of
#: 8 routes and Qwen3-30B-A3B's sizes)
CHUNK_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Tile sizes of the grouped kernels. ``block_m`` None: from the routes per expert."""

    block_m: Any = None  # routes per block (a power of two >= 16)
    block_n: int = 64  # output rows per program
    block_k: int = 64  # reduction step (a power of two >= 32: whole scale groups of 16 or 32 values)
    num_warps: int = 4
    num_stages: int = 2

    def routes_block(self, routes: int, num_experts: int) -> int:
        """Routes per block: ``block_m``, or twice the mean routes per expert as a power of two
        in 16..64, so that most experts' routes fit one block and each weight tile is decoded
        about once per launch (512 tokens of 8 routes over 128 experts: blocks of 64, 1.26-1.42
        times faster than blocks of the mean's 32 on an H100: tests/gpu/tune_grouped.py)."""
        if self.block_m is not None:
            return int(self.block_m)
        return min(64, max(16, triton.next_power_of_2(max(1, 2 * routes // max(num_experts, 1)))))

    def validate(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 32 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 32")
        if self.block_m is not None and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m={self.block_m}: must be a power of two >= 16 (tl.dot)")


#: the tiles every launch uses unless given others (read at each call: ``freetoken bench decode
#: --tiles grouped:...`` changes fields of it for one benchmark run)
DEFAULT_CONFIG = GroupedConfig()


@dataclasses.dataclass
class RouteGroups:
    """Routes sorted by expert: ``routes [blocks * block_m]`` int32 (flat route index
    ``t * K + k``, -1 = padding), ``block_expert [blocks]`` int32 (-1 = past the last
    block in use). ``blocks`` is the most any routing of this size needs."""

    routes: Any
    block_expert: Any
    block_m: int
    blocks: int


def group_routes(ids: Any, num_experts: int, block_m: int) -> RouteGroups:
    """Sort the routes of ``ids [T, K]`` (-1 = skipped) by expert into blocks of
    ``block_m``, on ids' device, without reading anything back to the host."""
    import torch

    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))  # skipped routes sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # (bincount reads its size back)
    padded = (counts + block_m - 1) // block_m * block_m
    ends_padded = torch.cumsum(padded, 0)
    starts_padded = ends_padded - padded
    starts = torch.cumsum(counts, 0) - counts
    blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    cap = blocks * block_m
    ekey = key[order]
    valid = ekey < num_experts
    e = ekey.clamp(max=num_experts - 1)
    dest = starts_padded[e] + torch.arange(n, device=dev) - starts[e]
    dest = torch.where(valid, dest, torch.full_like(dest, cap))  # skipped routes land in a spare slot
    routes = torch.full((cap + 1,), -1, dtype=torch.int32, device=dev)
    routes.scatter_(0, dest, order.to(torch.int32))
    first_row = torch.arange(blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(ends_padded, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return RouteGroups(routes[:cap], block_expert.to(torch.int32), block_m, blocks)


@triton.jit
def _weight_tile(
    w_u8, w_i8, w_f16, rows, row_ok, k0,
    NCOLS: tl.constexpr, FMT: tl.constexpr, RB: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_K]`` BF16: columns ``k0 ..`` of weight rows ``rows`` (int64 row
    indices); a plain tensor is read through ``w_u8`` (typed), a block format decoded."""
    if FMT == 0:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = w_u8 + rows[:, None] * NCOLS + offs_k[None, :]
        w = tl.load(ptrs, mask=row_ok[:, None] & (offs_k < NCOLS)[None, :], other=0.0)
    else:
        w = tl.reshape(dequant_tile(w_u8, w_i8, w_f16, rows * RB, row_ok, k0, NCOLS, FMT, BLOCK_K, G),
                       [BLOCK_N, BLOCK_K])
    return w.to(tl.bfloat16)


@triton.jit
def _gate_up_grouped_kernel(
    x_ptr, routes_ptr, block_expert_ptr,
    g_u8, g_i8, g_f16, u_u8, u_i8, u_f16,
    h_ptr,
    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    GATE_FMT: tl.constexpr, GATE_RB: tl.constexpr, GATE_G: tl.constexpr,
    UP_FMT: tl.constexpr, UP_RB: tl.constexpr, UP_G: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= 0:
        r = tl.load(routes_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_ok = r >= 0
        t = (tl.maximum(r, 0) // K).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        rows = e * I + offs_n.to(tl.int64)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, H, BLOCK_K):
            xk = tl.load(x_ptr + t[:, None] * H + (k0 + offs_k)[None, :],
                         mask=r_ok[:, None] & ((k0 + offs_k) < H)[None, :], other=0.0).to(tl.bfloat16)
            g = _weight_tile(g_u8, g_i8, g_f16, rows, n_ok, k0, H, GATE_FMT, GATE_RB, GATE_G, BLOCK_N, BLOCK_K)
            acc_g = tl.dot(xk, tl.trans(g), acc_g)
            u = _weight_tile(u_u8, u_i8, u_f16, rows, n_ok, k0, H, UP_FMT, UP_RB, UP_G, BLOCK_N, BLOCK_K)
            acc_u = tl.dot(xk, tl.trans(u), acc_u)
        act = activate(acc_g, acc_u, ACT, ALPHA, LIMIT)
        dst = h_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * I + offs_n[None, :]
        tl.store(dst, act.to(tl.bfloat16), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_grouped_kernel(
    h_ptr, routes_ptr, block_expert_ptr, w_ptr,
    d_u8, d_i8, d_f16,
    y_ptr,
    H: tl.constexpr, I: tl.constexpr,
    DOWN_FMT: tl.constexpr, DOWN_RB: tl.constexpr, DOWN_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= 0:
        r = tl.load(routes_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_ok = r >= 0
        r64 = tl.maximum(r, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        rows = e * H + offs_n.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            hk = tl.load(h_ptr + r64[:, None] * I + (k0 + offs_k)[None, :],
                         mask=r_ok[:, None] & ((k0 + offs_k) < I)[None, :], other=0.0)
            d = _weight_tile(d_u8, d_i8, d_f16, rows, n_ok, k0, I, DOWN_FMT, DOWN_RB, DOWN_G, BLOCK_N, BLOCK_K)
            acc = tl.dot(hk, tl.trans(d), acc)
        wr = tl.load(w_ptr + r64, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + r64[:, None] * H + offs_n[None, :], acc * wr[:, None], mask=r_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class _Weights:
    """One stack as the kernels take it: three views of its storage, format, row stride."""

    views: tuple[Any, Any, Any]
    fmt: int
    row_stride: int  # bytes per row (block formats) or values per row (plain)
    group: int
    num_experts: int
    rows: int
    cols: int


def _weights(stack: Any) -> _Weights:
    if isinstance(stack, PackedStack):
        return _Weights(stack.views(), stack.fmt, stack.row_bytes, stack.group, stack.num_experts, stack.rows,
                        stack.cols)
    if stack.dim() != 3 or not stack.is_contiguous():
        raise ValueError(f"plain expert weights must be a contiguous [E, rows, cols] tensor, got {tuple(stack.shape)}")
    e, rows, cols = (int(s) for s in stack.shape)
    return _Weights((stack, stack, stack), PLAIN, cols, 1, e, rows, cols)


def variant_key(x: Any, ids: Any, w: Any, config: Optional[GroupedConfig] = None) -> tuple[Any, ...]:
    """What selects the compiled variant beyond the stacks' formats and shapes (the token
    count is not specialised; the routes block is); ``config`` None: :data:`DEFAULT_CONFIG`."""
    return ("grouped", config or DEFAULT_CONFIG, ids.shape[1], x.dtype, w.dtype)


def launch(
    x: Any, ids: Any, w: Any, gate: Any, up: Any, down: Any, y: Any, activation: str,
    config: Optional[GroupedConfig] = None, alpha: float = 1.702, limit: float = 7.0,
) -> None:  # fmt: skip
    """``y [T, H]`` float32 (contiguous, overwritten) = the routed experts' output.

    ``x [T, H]`` (any float dtype), ``ids [T, K]`` (-1 = skip), ``w [T, K]``; ``gate/up``
    of ``[E, I, H]`` and ``down`` of ``[E, H, I]``, each a :class:`PackedStack` or a plain
    contiguous tensor. ``config`` None: :data:`DEFAULT_CONFIG`."""
    import torch

    config = config or DEFAULT_CONFIG
    tokens, top_k = ids.shape
    g, u, d = _weights(gate), _weights(up), _weights(down)
    inter, hidden = g.rows, g.cols
    if (u.rows, u.cols) != (inter, hidden) or (d.rows, d.cols) != (hidden, inter):
        raise ValueError(f"expert stacks: gate [{g.rows}, {g.cols}], up [{u.rows}, {u.cols}], down [{d.rows}, "
                         f"{d.cols}]: expected [I, H], [I, H], [H, I]")
    if y.dtype != torch.float32 or not y.is_contiguous() or tuple(y.shape) != (tokens, hidden):
        raise ValueError(f"y must be a contiguous float32 [{tokens}, {hidden}] tensor, got {y.dtype} {tuple(y.shape)}")
    if tokens == 0:
        return
    config.validate()
    if tokens > CHUNK_TOKENS:  # bounded temporaries: h and the per-route outputs of one chunk
        for t0 in range(0, tokens, CHUNK_TOKENS):
            t1 = min(tokens, t0 + CHUNK_TOKENS)
            launch(x[t0:t1], ids[t0:t1], w[t0:t1], gate, up, down, y[t0:t1], activation, config, alpha, limit)
        return
    x, w = x.contiguous(), w.contiguous().reshape(-1)
    groups = group_routes(ids, g.num_experts, config.routes_block(tokens * top_k, g.num_experts))
    h = torch.empty(tokens * top_k, inter, dtype=torch.bfloat16, device=x.device)
    y_routes = torch.zeros(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    opts = triton_target.for_device(x.device).launch_options(config.num_warps, config.num_stages)
    _gate_up_grouped_kernel[(groups.blocks, triton.cdiv(inter, config.block_n))](
        x, groups.routes, groups.block_expert, *g.views, *u.views, h, K=top_k, H=hidden, I=inter,
        GATE_FMT=g.fmt, GATE_RB=g.row_stride, GATE_G=g.group, UP_FMT=u.fmt, UP_RB=u.row_stride, UP_G=u.group,
        ACT=ACT_CODES[activation], ALPHA=float(alpha), LIMIT=float(limit),
        BLOCK_M=groups.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, **opts,
    )  # fmt: skip
    _down_grouped_kernel[(groups.blocks, triton.cdiv(hidden, config.block_n))](
        h, groups.routes, groups.block_expert, w, *d.views, y_routes, H=hidden, I=inter,
        DOWN_FMT=d.fmt, DOWN_RB=d.row_stride, DOWN_G=d.group,
        BLOCK_M=groups.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, **opts,
    )  # fmt: skip
    torch.sum(y_routes.view(tokens, top_k, hidden), dim=1, out=y)
