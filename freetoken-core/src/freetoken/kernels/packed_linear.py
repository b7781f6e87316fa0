"""Triton kernels of the dense linears kept on the GPU as a GGUF file's blocks.

A dense matrix ``W [N, K]`` (attention q/k/v/o, the output head, a dense MLP) stays on the
device as the file's bytes, ``[N, row_bytes(K)]`` uint8 in Q4_K, Q5_K, Q6_K or Q8_0, and
is read through the block decoding of :mod:`freetoken.kernels.moe_packed`
(``dequant_tile``, ``load_groups``, ``dequant_rows_kernel``): the weight values equal
gguf-py's bit for bit, products and sums are float32.

* :func:`gemv` -- decode (few tokens): ``y [T, N] = x [T, K] @ W.T``, one program per
  ``block_n`` output rows and up to ``block_t`` tokens. Each program reads its rows' blocks
  once per token tile, dequantizes them in registers (scales and mins once per group of
  32 or 16 values, broadcast over the group's codes) and multiplies them with the tokens
  in float32; the output is stored in ``y``'s dtype (the activation dtype). No host
  synchronisation and no allocation: capturable in CUDA graphs once the variant is
  compiled (an eager call with the same shapes compiles it).
* :func:`dequantize_rows` -- prefill: rows ``first .. first + rows`` of ``W`` dequantized
  into a buffer (the caller's reusable scratch), for a ``torch`` matmul.
* :func:`gather_rows` -- the token embedding: the rows of ``ids`` dequantized into ``out``
  (``[T, K]``), reading only those rows' blocks.

Performance model (decode on the H200, ~4.3 TB/s HBM): a Qwen3-30B-A3B layer's attention
in BF16 reads 37.7 MB (~9 us at HBM speed; ~12 us measured per layer), as Q4_K 10.6 MB
(~2.5 us at HBM speed). The kernel approaches memory speed at T = 1 when each program
streams a whole row's blocks in one step (``block_n`` rows x ``block_k`` columns; a row of
2048 Q4_K values is 1.1 KB) and there are enough programs in flight to cover the latency:
one program per row, 5120 for q/k/v fused and 2048 for o (measured 9.1 and 7.3 us, about
650 GB/s: the latency of a single pass, not the bandwidth, still bounds them). The weights are read once
per token tile of ``block_t`` tokens, so the kernel serves small T only
(``PackedLinearConfig.max_gemv_tokens``); larger batches dequantize into a scratch and
run a cuBLAS matmul, which reads the BF16 copy once. No split-K: every output row's sum is
one program's, so there are no atomics and the result does not depend on scheduling.
``tests/gpu/tune_cold.py`` sweeps the tiles on the Qwen3-30B-A3B shapes with the weights read
from HBM (``tests/gpu/tune_packed_dense.py`` replays one matrix, which stays in the L2).

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import triton
import triton.language as tl

from freetoken.backends import triton_target
from freetoken.kernels.moe_packed import (
    FMT_Q4_K,
    FMT_Q6_K,
    FORMAT_NAMES,
    FORMATS,
    PackedStack,
    capped_byte_tiles,
    dequant_rows_kernel,
    dequant_tile,
    load_groups,
    int8_dots_run_on,
)
from freetoken.kernels.packed_int8 import q4k_rows_int8, q6k_rows_int8

__all__ = ["FORMATS", "FORMAT_NAMES", "PackedLinearConfig", "DEFAULT_CONFIG", "WIDE_CONFIG", "NVIDIA_CONFIG",
           "NVIDIA_WIDE_CONFIG", "config_for", "PackedMatrix", "gemv", "dequantize_rows", "gather_rows", "variant_key"]


@dataclasses.dataclass(frozen=True)
class PackedLinearConfig:
    """Tile sizes of the packed GEMV and the batch sizes it serves."""

    #: output rows per program. One row of 2048-column steps: q/k/v [5120, 2048] 9.1 us and o
    #: [2048, 4096] 7.3 us on the H200 with the weights read from HBM, against 12.2 and 11.8 us
    #: for 4 x 512 tiles (tests/gpu/tune_cold.py)
    block_n: int = 1
    #: input columns per step for one token (a multiple of the 32 or 16 values sharing a
    #: scale); a tile of t tokens steps over block_k / t columns (at least 32), so a
    #: program's registers hold block_n x block_k products whatever the token tile
    block_k: int = 2048
    block_t: int = 8  # most tokens per program (the weights are read once per token tile)
    #: one token per program: Q4_K and Q6_K rows multiplied with the token quantized to int8,
    #: four products per instruction (freetoken.kernels.packed_int8; steps of >= 128
    #: columns; NVIDIA and the interpreter: AMD keeps the byte tiles); NVIDIA_CONFIG's, off here
    int8_dot: bool = False
    num_warps: int = 4
    num_stages: int = 2
    #: batches of at most this many tokens run the GEMV; larger ones are dequantized into
    #: the scratch and multiplied by torch
    max_gemv_tokens: int = 16

    def validate(self) -> None:
        for name in ("block_n", "block_t", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k={self.block_k}: must be a power of two >= 32 (a whole scale group)")
        if self.int8_dot and self.block_k < 128:
            raise ValueError(f"block_k={self.block_k}: int8 dots step over whole Q6_K half blocks (>= 128)")
        if self.max_gemv_tokens < 0:
            raise ValueError(f"max_gemv_tokens={self.max_gemv_tokens}: must be >= 0")

    def tokens_per_program(self, tokens: int) -> int:
        """The token tile of a batch of ``tokens``: ``block_t``, or fewer for a smaller batch."""
        return min(self.block_t, triton.next_power_of_2(max(tokens, 1)))

    def step_columns(self, tokens_per_program: int, cols: int) -> int:
        """Input columns per step of a program with ``tokens_per_program`` tokens."""
        return min(max(32, self.block_k // tokens_per_program), triton.next_power_of_2(cols))


#: the tiles every launch uses unless given others (``freetoken bench decode --tiles dense:...``
#: changes fields of it and of NVIDIA_CONFIG for one benchmark run)
DEFAULT_CONFIG = PackedLinearConfig()

#: matrices of at least this many rows (an output head: one row per vocabulary entry) take
#: :data:`WIDE_CONFIG`: on the H200, one token through the [151936, 2048] Q6_K head took
#: 254.8 us with 8 x 256 tiles against 336.0 us with 4 x 512 (tests/gpu/tune_packed_dense.py),
#: 256.9 us with its 255 MB read from HBM (~990 GB/s; the best of 16 tiles, tests/gpu/tune_cold.py)
WIDE_ROWS = 32768
#: (``freetoken bench decode --tiles dense-wide:...`` changes its fields and NVIDIA_WIDE_CONFIG's;
#: ``dense:`` does not)
WIDE_CONFIG = PackedLinearConfig(block_n=8, block_k=256)


#: NVIDIA: one token's Q4_K/Q6_K rows through int8 dots. Measured on the H200 with cold weights
#: (tests/gpu/tune_cold.py --int8): q/k/v [5120, 2048] Q4_K 7.0 us and o [2048, 4096] 7.6 us
#: against 9.1 and 7.2 (one config serves both: 14.6 against 16.3 us per layer); the
#: [151936, 2048] Q6_K head 234.7 us against 256.1 us
NVIDIA_CONFIG = PackedLinearConfig(block_n=8, num_warps=2, int8_dot=True)
NVIDIA_WIDE_CONFIG = PackedLinearConfig(block_n=64, block_k=512, num_warps=8, int8_dot=True)


def config_for(rows: int, device: Any = None) -> PackedLinearConfig:
    """The default tiles of a matrix of ``rows`` output rows on ``device``: the int8 ones on
    NVIDIA GPUs, the byte tiles elsewhere (and without a device)."""
    nvidia = device is not None and triton_target.for_device(device).backend == "cuda"
    if rows >= WIDE_ROWS:
        return NVIDIA_WIDE_CONFIG if nvidia else WIDE_CONFIG
    return NVIDIA_CONFIG if nvidia else DEFAULT_CONFIG


@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """A matrix ``[rows, cols]`` on the device as its file bytes (``stack``: one expert's
    :class:`~freetoken.kernels.moe_packed.PackedStack`, ``data [1, rows, row_bytes]``)."""

    stack: PackedStack

    @classmethod
    def from_bytes(cls, data: Any, fmt: int, rows: int, cols: int) -> "PackedMatrix":
        return cls(PackedStack.from_bytes(data, fmt, 1, rows, cols))

    @property
    def rows(self) -> int:
        return self.stack.rows

    @property
    def cols(self) -> int:
        return self.stack.cols

    @property
    def fmt(self) -> int:
        return self.stack.fmt

    @property
    def nbytes(self) -> int:
        return self.stack.nbytes


@triton.jit(do_not_specialize=["T"])
def _packed_gemv_kernel(
    x_ptr, w_u8, w_i8, w_f16, y_ptr, T,
    N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, RB: tl.constexpr, G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    INT8: tl.constexpr, DP4A: tl.constexpr,
):  # fmt: skip
    """``y[t, n] = sum_k x[t, k] * W[n, k]`` for the program's ``BLOCK_N`` rows and
    ``BLOCK_T`` tokens (x ``[T, K]``, y ``[T, N]``, contiguous)."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64) * RB
    if BLOCK_T == 1:
        # one token: the tile stays in its [rows, groups, G] layout, no reshape
        t = pid_t.to(tl.int64)
        if INT8 and (FMT == 12 or FMT == 14):  # the token quantized per step, once for the program's rows
            x_row = tl.zeros([1], dtype=tl.int64) + t
            acc8 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k3 in range(0, K, BLOCK_K):
                if FMT == 12:
                    acc8 += q4k_rows_int8(w_u8, w_f16, rows, n_ok, x_ptr, x_row, x_row >= 0, k3, K, BLOCK_K, 1, DP4A,
                                           False, 0)  # fmt: skip
                else:
                    acc8 += q6k_rows_int8(w_u8, w_f16, rows, n_ok, x_ptr, x_row, x_row >= 0, k3, K, BLOCK_K, 1, DP4A,
                                           False, 0)  # fmt: skip
            y = acc8
        else:
            x_row = x_ptr + t * K
            acc = tl.zeros([BLOCK_N, BLOCK_K // G, G], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xg = load_groups(x_row, k0, K, BLOCK_K, G, True)
                w = dequant_tile(w_u8, w_i8, w_f16, rows, n_ok, k0, K, FMT, BLOCK_K, G)
                acc += w * xg[None, :, :]
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + t * N + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * K
        acc2 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + offs_k[None, :], mask=t_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            w = tl.reshape(dequant_tile(w_u8, w_i8, w_f16, rows, n_ok, k0, K, FMT, BLOCK_K, G), [BLOCK_N, BLOCK_K])
            acc2 += w[None, :, :] * xt.to(tl.float32)[:, None, :]
        y2 = tl.sum(acc2, axis=2)
        dst = y_ptr + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(dst, y2.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _gather_rows_kernel(
    ids_ptr, w_u8, w_i8, w_f16, out_ptr, T,
    V: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, RB: tl.constexpr, G: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``out[t, :] = dequant(W[ids[t], :])`` in out's dtype; ids outside ``[0, V)`` are
    clamped (the engine checks token ids against the vocabulary before a step)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    row = tl.load(ids_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    row = tl.minimum(tl.maximum(row, 0), V - 1)
    c0 = tl.program_id(1) * BLOCK_C
    w = dequant_tile(w_u8, w_i8, w_f16, row * RB, t_ok, c0, K, FMT, BLOCK_C, G)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    dst = out_ptr + offs_t.to(tl.int64)[:, None] * K + offs_c[None, :]
    tl.store(dst, tl.reshape(w, [BLOCK_T, BLOCK_C]).to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & (offs_c < K)[None, :])


def _check_2d(name: str, t: Any, rows: int, cols: int) -> None:
    if tuple(t.shape) != (rows, cols) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [{rows}, {cols}] tensor, got {tuple(t.shape)}")


def one_token_tiles(config: PackedLinearConfig, fmt: int, backend: str) -> PackedLinearConfig:
    """``config`` as one token's GEMV runs it on a Triton ``backend``: as given where its int8
    dots run (Q4_K, Q6_K rows) and off NVIDIA GPUs; else (the byte tiles on NVIDIA) with at
    most :data:`~freetoken.kernels.moe_packed.BYTE_TILE_VALUES` accumulator values per
    thread (``block_n * block_k / (32 * num_warps)``): more warps (up to 8), then narrower
    steps. Compiled for sm_90, NVIDIA_CONFIG's 8 x 2048 tiles with 2 warps kept 3.2 KB a
    thread in local memory over Q8_0 rows of 2880 columns and 2.1 KB over Q5_K ones
    (tests/gpu/packed_sm90_spills.py). ``block_n`` is kept (the grid)."""
    if backend != "cuda" or (config.int8_dot and fmt in (FMT_Q4_K, FMT_Q6_K)):
        return config
    block_k, warps = capped_byte_tiles(config.block_n, config.block_k, config.num_warps, 32)
    if (block_k, warps) == (config.block_k, config.num_warps):
        return config
    return dataclasses.replace(config, block_k=block_k, num_warps=warps)


def gemv(x: Any, w: PackedMatrix, y: Any, config: PackedLinearConfig = DEFAULT_CONFIG) -> Any:
    """``y [T, N] = x [T, K] @ W.T`` (x any float dtype, y BF16/FP16/FP32; both contiguous),
    in one launch; the weights are read once per ``config.block_t`` tokens."""
    tokens = int(x.shape[0])
    _check_2d("x", x, tokens, w.cols)
    _check_2d("y", y, tokens, w.rows)
    if tokens == 0:
        return y
    bt = config.tokens_per_program(tokens)
    st = w.stack
    target = triton_target.for_device(x.device)
    if bt == 1:
        config = one_token_tiles(config, st.fmt, target.backend)
    _packed_gemv_kernel[(triton.cdiv(w.rows, config.block_n), triton.cdiv(tokens, bt))](
        x, *st.views(), y, tokens, N=w.rows, K=w.cols, FMT=st.fmt, RB=st.row_bytes, G=st.group,
        BLOCK_N=config.block_n, BLOCK_K=config.step_columns(bt, w.cols), BLOCK_T=bt,
        INT8=config.int8_dot and int8_dots_run_on(x.device), DP4A=config.int8_dot and target.backend == "cuda",
        **target.launch_options(config.num_warps, config.num_stages),
    )  # fmt: skip
    return y


def dequantize_rows(w: PackedMatrix, out: Any, first: int = 0) -> Any:
    """Rows ``first .. first + out.shape[0]`` of ``W`` dequantized into ``out`` (``[rows,
    K]``, contiguous, BF16/FP16/FP32), in one launch."""
    rows = int(out.shape[0])
    _check_2d("out", out, rows, w.cols)
    if not 0 <= first <= w.rows - rows:
        raise ValueError(f"rows {first}..{first + rows} outside the matrix's {w.rows} rows")
    if rows == 0:
        return out
    st = w.stack
    block_r, block_c = 16, min(256, triton.next_power_of_2(w.cols))
    dequant_rows_kernel[(triton.cdiv(rows, block_r), triton.cdiv(w.cols, block_c))](
        *st.views(), out, first, rows, NCOLS=w.cols, FMT=st.fmt, RB=st.row_bytes, G=st.group,
        BLOCK_R=block_r, BLOCK_C=block_c, **triton_target.for_device(out.device).launch_options(4),
    )  # fmt: skip
    return out


def gather_rows(ids: Any, w: PackedMatrix, out: Any, block_t: int = 4, block_c: int = 1024) -> Any:
    """``out [T, K]`` = the rows ``ids [T]`` (int32/int64, contiguous) of ``W`` dequantized,
    in one launch (only those rows' blocks are read)."""
    tokens = int(ids.shape[0])
    _check_2d("out", out, tokens, w.cols)
    if tokens == 0:
        return out
    st = w.stack
    block_c = min(block_c, triton.next_power_of_2(w.cols))
    _gather_rows_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(w.cols, block_c))](
        ids, *st.views(), out, tokens, V=w.rows, K=w.cols, FMT=st.fmt, RB=st.row_bytes, G=st.group,
        BLOCK_T=block_t, BLOCK_C=block_c, **triton_target.for_device(out.device).launch_options(4),
    )  # fmt: skip
    return out


def variant_key(x: Any, w: PackedMatrix, config: PackedLinearConfig = DEFAULT_CONFIG) -> tuple[Any, ...]:
    """What selects the compiled GEMV variant beyond the matrix's shape and format: the
    config, the token tile, the activation dtype and 16-byte alignment of x (the token
    count itself is not specialised)."""
    return (config, config.tokens_per_program(int(x.shape[0])), x.dtype, x.data_ptr() % 16 == 0)
