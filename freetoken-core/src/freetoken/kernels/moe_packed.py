"""Fused MoE over routed experts kept on the GPU in their GGUF block formats.

The expert stacks are the file's bytes, moved to the device unchanged: ``gate/up
[E, I, row_bytes(H)]`` and ``down [E, H, row_bytes(I)]`` uint8, each in one of Q4_K,
Q5_K, Q6_K, Q8_0 or MXFP4 (the three may differ: Q4_K_M files mix Q4_K and Q6_K); FP8
block-scaled experts are rearranged once into rows of blocks of their own
(:meth:`PackedStack.from_fp8`). Each program
dequantizes its weight tile in registers and multiplies it with the activation in
float32; nothing is written back but the activations ``h`` and the output ``y``. Two
per-route kernels, the design of :mod:`freetoken.kernels.moe_experts`'s
``_gate_up_routes_kernel`` / ``_down_routes_kernel`` (no idle program, no atomics, ids
``-1`` skipped)::

    gate_up  grid (T*K, cdiv(I, BLOCK_I)): route r = (t, k) of expert e = ids[t, k]:
             h[t, k, i] = act(x_t . gate_e[i, :], x_t . up_e[i, :])      (float32)
    down     grid (T, cdiv(H, BLOCK_N)):
             y[t, n] = sum_k w[t, k] * (h[t, k, :] . down_{ids[t, k]}[n, :])

Weights are read once per route (once per distinct expert when a batch's routes share
no expert, the common case at small ``T``).

``int8_dot`` (with ``int8_h``) changes what is multiplied: activations quantized to int8 and
the codes multiplied as integers (:mod:`freetoken.kernels.packed_int8`); NVIDIA GPUs
run them by default (:func:`default_config`, :data:`NVIDIA_CONFIG`). ``down_routes_tile``
(on by default; ``tests/gpu/tune_cold.py`` times it with the weights read from HBM) changes
how, not what: it makes the token's K routes a tile dimension of the down kernel (rows
``(k, n)``, all routes' weights loaded in one step, the sum over ``k`` taken at the end in a
fixed order) instead of a loop over them, so a step has K times the loads in flight and a
smaller ``BLOCK_N`` gives more programs.

Tiles. A step of ``BLOCK_C`` columns of ``R`` rows is held as ``[R, BLOCK_C / G, G]``,
``G`` the values sharing one scale: 32 in Q4_K/Q5_K (a sub-block: 6-bit scale and min),
Q8_0 (a block: f16 scale) and MXFP4 (a block: E8M0 exponent), 16 in Q6_K (int8 scale), 32
in the FP8 rows (a quarter of a block, its scale loaded once per group). Scales and mins are decoded once per
group (``[R, BLOCK_C / G]``) and broadcast over its ``G`` codes. The arithmetic is that
of gguf-py's dequantization and :mod:`freetoken.loading.dequant` (``(d*sc) * q - dmin*m``,
``(d*sc) * (q - 32)``, ``q * d``), so the weight values equal theirs bit for bit; products
and sums are float32. Byte layouts (offsets in a block):

* Q8_0 (32 values, 34 B): f16 ``d`` at 0, int8 codes at 2.
* FP8 rows (128 values, 132 B; :meth:`PackedStack.from_fp8`, not a file format): float32
  scale of the value's 128 x 128 tile at 0, E4M3 codes at 4.
* MXFP4 (32 values, 17 B): E8M0 exponent ``e`` at 0 (scale ``2^(e - 128)``, as ggml's
  half-scale with doubled E2M1 values 0 1 2 3 4 6 8 12 and their negatives), 4-bit codes
  at 1: value ``l < 16`` in the low nibble of byte ``1 + l``, value ``l + 16`` in its high
  nibble.
* Q4_K (256 values, 144 B): f16 ``d`` at 0, f16 ``dmin`` at 2, 12 bytes of 6-bit scales
  and mins at 4, nibbles at 16 (byte ``16 + 32*(s//2) + l``, low nibble for even
  sub-block ``s``, high for odd).
* Q5_K (256 values, 176 B): as Q4_K with the fifth bits at 16 (bit ``s`` of byte
  ``16 + l``) and the nibbles at 48.
* Q6_K (256 values, 210 B): low nibbles at 0, 2-bit high parts at 128, int8 scales at
  192 (one per 16 values), f16 ``d`` at 208. Value ``j = 128*n + 32*k + l``: low bits in
  byte ``64*n + 32*(k%2) + l`` (high nibble when ``k >= 2``), high bits ``2k..2k+1`` of
  byte ``128 + 32*n + l``.

Every field is read through one of three views of the same bytes (uint8, int8, and
float16: every f16 field lies at an even offset, as the block sizes of the formats with
f16 fields are even).

Batches above ``PackedConfig.max_routes`` routes are not served here:
:class:`freetoken.moe.experts.gpu_packed_experts.PackedGpuExperts` dequantizes the experts to
BF16 and runs :func:`freetoken.kernels.moe_experts.launch` for them.

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import triton
import triton.language as tl

from freetoken.backends import triton_target
from freetoken.kernels.moe_experts import ACT_CODES, activate
from freetoken.kernels.packed_int8 import dot_q4k_int8, q4k_rows_int8, q6k_rows_int8, store_quantized, x_groups

FMT_Q8_0, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_MXFP4 = 8, 12, 13, 14, 39  # ggml type ids (freetoken.handoff.Fmt)
#: FP8 E4M3 with one float32 scale per 128 x 128 tile (freetoken.handoff.Fmt.FP8_E4M3_B128),
#: held on the device in rows of 132-byte blocks (:meth:`PackedStack.from_fp8`)
FMT_FP8_B128 = 100

#: Per block format: (values per block, bytes per block, values per scale group ``G``).
FORMATS: dict[int, tuple[int, int, int]] = {
    FMT_Q8_0: (32, 34, 32),
    FMT_Q4_K: (256, 144, 32),
    FMT_Q5_K: (256, 176, 32),
    FMT_Q6_K: (256, 210, 16),
    FMT_MXFP4: (32, 17, 32),
    FMT_FP8_B128: (128, 132, 32),
}
FORMAT_NAMES = {FMT_Q8_0: "Q8_0", FMT_Q4_K: "Q4_K", FMT_Q5_K: "Q5_K", FMT_Q6_K: "Q6_K", FMT_MXFP4: "MXFP4",
                FMT_FP8_B128: "FP8_B128"}


@dataclasses.dataclass(frozen=True)
class PackedConfig:
    """Tile sizes of the packed kernels and the batch size they serve."""

    # measured on the H200 with the weights read from HBM, as in a model (tests/gpu/tune_cold.py:
    # a Qwen3-30B-A3B layer, T=1, K=8, each launch on other experts): gate/up 2 x 2048 tiles
    # with 2 warps 15.9 us against 17.7 us for 4 x 512 with 4; down (Q6_K) with the routes as
    # a tile dimension and 4 x 256 tiles 21.7 us against 24.8 us for the loop over the routes
    block_i: int = 2  # gate_up: intermediate rows per program
    block_h: int = 2048  # gate_up: hidden columns per step
    block_n: int = 4  # down: hidden rows per program
    block_r: int = 256  # down: intermediate columns per step
    #: down: the token's K routes as a tile dimension (all routes' weights loaded in one
    #: step, K times the loads in flight) rather than a loop over them
    down_routes_tile: bool = True
    num_warps: int = 2
    #: warps of the down kernel's programs (0: ``num_warps``)
    down_num_warps: int = 4
    #: down with the routes tile (byte loads): each route's ``h`` columns loaded once per step
    #: and broadcast over its ``block_n`` rows, instead of once per row; off until measured
    #: (tests/gpu/tune_cold.py)
    down_h_once: bool = False
    #: Q4_K gate/up and Q4_K/Q6_K down (the routes tile) multiply int8-quantized activations
    #: with the weights' integer codes, four products per instruction
    #: (freetoken.kernels.packed_int8): a fraction of the byte tiles' instructions, at the
    #: activations' int8 rounding (~1e-3 of a row's sum); other formats keep the byte tiles, as
    #: does AMD (for_target). NVIDIA_CONFIG's, off here
    int8_dot: bool = False
    #: with int8_dot: the gate/up kernel stores h quantized per 16 values and the down kernel
    #: reads the codes, instead of every down program quantizing h (block_i a multiple of 16)
    int8_h: bool = False
    num_stages: int = 2
    #: batches of at most this many routes (T * K) run the packed kernels; larger ones
    #: are dequantized to BF16 (see PackedGpuExperts)
    max_routes: int = 256

    def validate(self) -> None:
        for name in ("block_i", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        for name in ("block_h", "block_r"):
            v = getattr(self, name)
            if v < 32 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 32 (a whole scale group)")
        if self.int8_dot and (self.block_h < 64 or self.block_r < 128):
            raise ValueError(f"block_h={self.block_h}, block_r={self.block_r}: int8 dots step over whole pairs of "
                             "Q4_K sub-blocks (block_h >= 64) and Q6_K half blocks (block_r >= 128)")
        if self.int8_h and (not self.int8_dot or self.block_i % 16):
            raise ValueError(f"int8_h with int8_dot={self.int8_dot}, block_i={self.block_i}: h is quantized by "
                             "gate/up programs of whole 16-value groups (int8_dot=1 and block_i a multiple of 16)")
        for name in ("num_warps", "down_num_warps"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1) or (v == 0 and name == "num_warps"):
                raise ValueError(f"{name}={v}: must be a power of two" + (" or 0" if name == "down_num_warps" else ""))
        if self.max_routes < 0:
            raise ValueError(f"max_routes={self.max_routes}: must be >= 0")


#: the byte tiles: the launches' default where int8 dots do not run (AMD, the interpreter) and
#: of explicit launches (``freetoken bench decode --tiles experts:...`` changes fields of both
#: configs for one benchmark run)
DEFAULT_CONFIG = PackedConfig()

#: NVIDIA: int8 dots, h quantized by the gate/up kernel. Measured on the H200 with cold weights
#: (tests/gpu/tune_cold.py --int8, a Qwen3-30B-A3B layer, T=1, K=8): gate/up 12.1 us and down
#: 14.2 us, 26.3 us per layer against 37.1 us for the byte tiles
NVIDIA_CONFIG = PackedConfig(block_i=16, block_n=8, num_warps=4, int8_dot=True, int8_h=True)


def default_config(device: Any) -> PackedConfig:
    """The tiles of a device's experts unless given others: :data:`NVIDIA_CONFIG` on NVIDIA
    GPUs, :data:`DEFAULT_CONFIG` elsewhere (tests that run the interpreter ask for int8 dots
    where they test them)."""
    return NVIDIA_CONFIG if triton_target.for_device(device).backend == "cuda" else DEFAULT_CONFIG


@dataclasses.dataclass(frozen=True)
class PackedStack:
    """One expert stack on the device as its file bytes: ``data [E, rows, row_bytes]``
    uint8 holding ``rows x cols`` values per expert in block format ``fmt``."""

    data: Any
    fmt: int
    rows: int
    cols: int

    @classmethod
    def from_bytes(cls, data: Any, fmt: int, num_experts: int, rows: int, cols: int) -> "PackedStack":
        import torch

        fmt = int(fmt)
        if fmt not in FORMATS:
            raise ValueError(f"packed experts: ggml type {fmt} is not one of {sorted(FORMAT_NAMES.values())}")
        per, nbytes, _ = FORMATS[fmt]
        if cols % per:
            raise ValueError(f"packed experts: {FORMAT_NAMES[fmt]} rows need a multiple of {per} values, got {cols}")
        if data.dtype == torch.int8:
            data = data.view(torch.uint8)
        if data.dtype != torch.uint8:
            raise TypeError(f"packed experts: expected uint8 bytes, got {data.dtype}")
        rb = cols // per * nbytes
        if data.numel() != num_experts * rows * rb:
            raise ValueError(
                f"packed experts: {data.numel()} bytes do not hold {num_experts} x [{rows}, {cols}] "
                f"{FORMAT_NAMES[fmt]} ({num_experts * rows * rb} bytes)"
            )
        return cls(data.reshape(num_experts, rows, rb).contiguous(), fmt, rows, cols)

    @classmethod
    def from_fp8(cls, codes: Any, scale: Any, device: Any) -> "PackedStack":
        """FP8 E4M3 experts ``codes [E, rows, cols]`` (uint8 or float8_e4m3fn) with their
        float32 ``scale [E, ceil(rows / 128), cols / 128]`` (one per 128 x 128 tile) as rows
        of 132-byte blocks on ``device``: each 128 codes of a row preceded by its tile's
        scale (4 bytes per 128, 3.1% over the codes), so a row is read on its own like the
        GGUF block formats."""
        import torch

        e, rows, cols = (int(s) for s in codes.shape)
        if cols % 128:
            raise ValueError(f"packed FP8 experts: rows need a multiple of 128 values, got {cols}")
        tiles = (e, -(-rows // 128), cols // 128)
        if tuple(scale.shape) != tiles:
            raise ValueError(f"packed FP8 experts: scale {tuple(scale.shape)} does not match codes "
                             f"{tuple(codes.shape)} (expected {tiles}: one per 128 x 128 tile)")
        q = codes.to(device).view(torch.uint8).reshape(e, rows, cols // 128, 128)
        s = scale.to(device=device, dtype=torch.float32).repeat_interleave(128, dim=1)[:, :rows]
        s = s.contiguous().view(torch.uint8).reshape(e, rows, cols // 128, 4)
        return cls(torch.cat([s, q], dim=3).reshape(e, rows, cols // 128 * 132).contiguous(), FMT_FP8_B128, rows, cols)

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_bytes(self) -> int:
        per, nbytes, _ = FORMATS[self.fmt]
        return self.cols // per * nbytes

    @property
    def group(self) -> int:
        return FORMATS[self.fmt][2]

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def views(self) -> tuple[Any, Any, Any]:
        """The bytes as uint8, int8 and float16 (flat). MXFP4 has no 16-bit field and its
        17-byte blocks may leave an odd byte count: its third view is the uint8 one."""
        import torch

        flat = self.data.view(-1)
        return flat, flat.view(torch.int8), flat if self.fmt == FMT_MXFP4 else flat.view(torch.float16)


@triton.jit
def dequant_tile(
    u8_ptr, i8_ptr, f16_ptr, row_off, row_ok, c0,
    NCOLS: tl.constexpr, FMT: tl.constexpr, BLOCK_C: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """``[R, BLOCK_C // G, G]`` float32: columns ``c0 .. c0 + BLOCK_C`` of the rows at byte
    offsets ``row_off [R]`` (int64); masked rows and columns past ``NCOLS`` are zero."""
    offs_l = tl.arange(0, G)
    cs = c0 + tl.arange(0, BLOCK_C // G) * G  # [S]: first column of each group
    m2 = row_ok[:, None] & (cs < NCOLS)[None, :]  # [R, S] (groups are whole: NCOLS % G == 0)
    m3 = m2[:, :, None]
    ro = row_off[:, None]
    if FMT == 100:  # FP8 E4M3 rows of 132-byte blocks: float32 tile scale, then 128 codes
        blk = ro + (cs // 128 * 132)[None, :]
        d = tl.load(u8_ptr.to(tl.pointer_type(tl.float32)) + blk // 4, mask=m2, other=0.0)
        q = tl.load(u8_ptr + (blk + 4 + cs % 128)[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.int32)
        ex = (q >> 3) & 15
        mant = q & 7
        # normal: 2^(ex - 7) * (1 + mant / 8) (the float32 with those exponent and top mantissa
        # bits); subnormal (ex = 0): mant * 2^-9. The NaN codes (0x7f, 0xff) read as +-480.
        normal = ((ex + 120) << 23 | mant << 20).to(tl.float32, bitcast=True)
        mag = tl.where(ex == 0, mant.to(tl.float32) * 0.001953125, normal)
        w = d[:, :, None] * tl.where(q >= 128, -mag, mag)
    elif FMT == 39:  # MXFP4: code c (sign, 2-bit exponent, 1-bit mantissa) times 2^(e - 128)
        blk = ro + (cs // 32 * 17)[None, :]
        e = tl.load(u8_ptr + blk, mask=m2, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # subnormal below e=2
        half = offs_l // 16  # values 0..15: low nibbles of bytes 1..16; 16..31: high nibbles
        qb = tl.load(u8_ptr + (blk + 1)[:, :, None] + (offs_l % 16)[None, None, :], mask=m3, other=0).to(tl.int32)
        c = (qb >> (4 * half)[None, None, :]) & 15
        ex = (c >> 1) & 3
        mag = tl.where(ex == 0, c & 1, (2 + (c & 1)) << tl.maximum(ex - 1, 0))  # 0 1 2 3 4 6 8 12
        w = d[:, :, None] * tl.where(c >= 8, -mag, mag).to(tl.float32)
    elif FMT == 8:  # Q8_0: q * d
        blk = ro + (cs // 32 * 34)[None, :]  # [R, S] byte offset of the group's block
        d = tl.load(f16_ptr + blk // 2, mask=m2, other=0.0).to(tl.float32)
        q = tl.load(i8_ptr + (blk + 2)[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.float32)
        w = q * d[:, :, None]
    elif FMT == 14:  # Q6_K: (d * sc) * (q - 32), 16 values per scale
        blk = ro + (cs // 256 * 210)[None, :]
        j = cs % 256
        n = j // 128
        k = (j % 128) // 32
        l0 = j % 32  # 0 or 16
        ql_off = blk + (n * 64 + (k % 2) * 32 + l0)[None, :]
        qh_off = blk + (128 + n * 32 + l0)[None, :]
        ql = tl.load(u8_ptr + ql_off[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.int32)
        qh = tl.load(u8_ptr + qh_off[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.int32)
        q = ((ql >> (4 * (k // 2))[None, :, None]) & 15) | (((qh >> (2 * k)[None, :, None]) & 3) << 4)
        sc = tl.load(i8_ptr + blk + (192 + j // 16)[None, :], mask=m2, other=0).to(tl.float32)
        d = tl.load(f16_ptr + (blk + 208) // 2, mask=m2, other=0.0).to(tl.float32)
        w = (d * sc)[:, :, None] * (q - 32).to(tl.float32)
    else:  # Q4_K / Q5_K: (d * sc) * q - dmin * m, 32 values per scale
        blk = ro + (cs // 256 * (144 + 32 * (FMT - 12)))[None, :]  # 144 (Q4_K) or 176 (Q5_K) bytes
        s = (cs % 256) // 32  # sub-block 0..7
        # 12 scale bytes at 4: a = bytes 4..7, b = 8..11, c = 12..15; sub-block s < 4:
        # sc = a[s] & 63, m = b[s] & 63; s >= 4: low 4 bits in c[s-4], top 2 in a/b[s-4]
        s4 = (s % 4)[None, :]
        a = tl.load(u8_ptr + blk + 4 + s4, mask=m2, other=0).to(tl.int32)
        b = tl.load(u8_ptr + blk + 8 + s4, mask=m2, other=0).to(tl.int32)
        c = tl.load(u8_ptr + blk + 12 + s4, mask=m2, other=0).to(tl.int32)
        hi = (s >= 4)[None, :]
        sc = tl.where(hi, (c & 15) | ((a >> 6) << 4), a & 63)
        mn = tl.where(hi, (c >> 4) | ((b >> 6) << 4), b & 63)
        d = tl.load(f16_ptr + blk // 2, mask=m2, other=0.0).to(tl.float32)
        dmin = tl.load(f16_ptr + blk // 2 + 1, mask=m2, other=0.0).to(tl.float32)
        q_off = blk + (16 + 32 * (FMT - 12) + (s // 2) * 32)[None, :]  # nibbles at 16 (Q4_K) or 48 (Q5_K)
        qb = tl.load(u8_ptr + q_off[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.int32)
        q = (qb >> ((s % 2) * 4)[None, :, None]) & 15
        if FMT == 13:  # fifth bit: bit s of byte 16 + l
            qh = tl.load(u8_ptr + (blk + 16)[:, :, None] + offs_l[None, None, :], mask=m3, other=0).to(tl.int32)
            q = q | (((qh >> s[None, :, None]) & 1) << 4)
        w = (d * sc.to(tl.float32))[:, :, None] * q.to(tl.float32) - (dmin * mn.to(tl.float32))[:, :, None]
    return w


@triton.jit
def load_groups(ptr, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr, G: tl.constexpr, ok):
    """``[BLOCK_C // G, G]`` float32: ``ptr[c0 .. c0 + BLOCK_C]`` (zero past ``NCOLS`` or when not ``ok``)."""
    offs = c0 + tl.arange(0, BLOCK_C // G)[:, None] * G + tl.arange(0, G)[None, :]
    return tl.load(ptr + offs, mask=(offs < NCOLS) & ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _gate_up_packed_kernel(
    x_ptr, ids_ptr, table_ptr,
    g_u8, g_i8, g_f16, u_u8, u_i8, u_f16,
    h_ptr,
    T, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    GATE_FMT: tl.constexpr, GATE_RB: tl.constexpr, GATE_G: tl.constexpr,
    UP_FMT: tl.constexpr, UP_RB: tl.constexpr, UP_G: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, SLOTS: tl.constexpr,
    INT8: tl.constexpr, DP4A: tl.constexpr, H_INT8: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    pid_i = tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64)
    if SLOTS:  # ids number the experts of another table: table_ptr maps them to this stack's (-1: none)
        e = tl.load(table_ptr + tl.maximum(e, 0), mask=e >= 0, other=-1).to(tl.int64)
    if e >= 0:
        t = r // K
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        rows = e * I + offs_i.to(tl.int64)
        g_rows = rows * GATE_RB
        u_rows = rows * UP_RB
        if INT8 and GATE_FMT == 12 and UP_FMT == 12:  # the activations quantized once per step for both
            x_row = tl.zeros([1], dtype=tl.int64) + t
            acc_g8 = tl.zeros([BLOCK_I, BLOCK_H // 64], dtype=tl.float32)
            acc_u8 = tl.zeros([BLOCK_I, BLOCK_H // 64], dtype=tl.float32)
            for h2 in range(0, H, BLOCK_H):
                pg = h2 // 64 + tl.arange(0, BLOCK_H // 64)
                p_ok = pg * 64 < H
                x_lo, d_lo, s_lo = x_groups(x_ptr, x_row, x_row >= 0, 2 * pg, p_ok, H, False, 0)
                x_hi, d_hi, s_hi = x_groups(x_ptr, x_row, x_row >= 0, 2 * pg + 1, p_ok, H, False, 0)
                acc_g8 += dot_q4k_int8(g_u8, g_f16, g_rows, i_ok, pg, p_ok, x_lo, d_lo, s_lo, x_hi, d_hi, s_hi, DP4A)
                acc_u8 += dot_q4k_int8(u_u8, u_f16, u_rows, i_ok, pg, p_ok, x_lo, d_lo, s_lo, x_hi, d_hi, s_hi, DP4A)
            gs = tl.sum(acc_g8, axis=1)
            us = tl.sum(acc_u8, axis=1)
        else:
            acc_g = tl.zeros([BLOCK_I, BLOCK_H // GATE_G, GATE_G], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I, BLOCK_H // UP_G, UP_G], dtype=tl.float32)
            x_row = x_ptr + t * H
            for h0 in range(0, H, BLOCK_H):
                xg = load_groups(x_row, h0, H, BLOCK_H, GATE_G, True)
                g = dequant_tile(g_u8, g_i8, g_f16, g_rows, i_ok, h0, H, GATE_FMT, BLOCK_H, GATE_G)
                acc_g += g * xg[None, :, :]
                xu = load_groups(x_row, h0, H, BLOCK_H, UP_G, True)
                u = dequant_tile(u_u8, u_i8, u_f16, u_rows, i_ok, h0, H, UP_FMT, BLOCK_H, UP_G)
                acc_u += u * xu[None, :, :]
            gs = tl.sum(tl.sum(acc_g, axis=2), axis=1)
            us = tl.sum(tl.sum(acc_u, axis=2), axis=1)
        act = activate(gs, us, ACT, ALPHA, LIMIT)
        if H_INT8:  # h quantized here for the down kernel's int8 dots (BLOCK_I: whole groups of 16)
            store_quantized(h_ptr, r, T * K, I, pid_i * BLOCK_I, tl.where(i_ok, act, 0.0))
        else:
            tl.store(h_ptr + r.to(tl.int64) * I + offs_i, act, mask=i_ok)


@triton.jit(do_not_specialize=["T"])
def _down_packed_kernel(
    h_ptr, ids_ptr, table_ptr, w_ptr,
    d_u8, d_i8, d_f16,
    y_ptr,
    T, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    DOWN_FMT: tl.constexpr, DOWN_RB: tl.constexpr, DOWN_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, KP: tl.constexpr, ROUTES_TILE: tl.constexpr,
    SLOTS: tl.constexpr, H_ONCE: tl.constexpr, INT8: tl.constexpr, DP4A: tl.constexpr,
    H_INT8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if ROUTES_TILE:
        # the token's K routes side by side: tile rows are (route k, hidden row n), so every
        # route's weights are read in the same step (K times the loads in flight of a loop
        # over the routes); the sum over the routes is the program's, in a fixed order
        offs_k = tl.arange(0, KP)
        e = tl.load(ids_ptr + t * K + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        if SLOTS:
            e = tl.load(table_ptr + tl.maximum(e, 0), mask=e >= 0, other=-1).to(tl.int64)
        ok = e >= 0
        wk = tl.load(w_ptr + t * K + offs_k, mask=ok, other=0.0).to(tl.float32)
        rows = tl.reshape((tl.maximum(e, 0) * H)[:, None] + offs_n.to(tl.int64)[None, :], [KP * BLOCK_N]) * DOWN_RB
        row_ok = tl.reshape(ok[:, None] & n_ok[None, :], [KP * BLOCK_N])
        h_rows = tl.reshape((t * K + offs_k)[:, None] + tl.zeros([BLOCK_N], dtype=tl.int64)[None, :], [KP * BLOCK_N]) * I
        cols = tl.arange(0, BLOCK_R // DOWN_G)[:, None] * DOWN_G + tl.arange(0, DOWN_G)[None, :]
        if INT8 and (DOWN_FMT == 12 or DOWN_FMT == 14):
            # each route's h quantized (here, or by the gate/up kernel: H_INT8), serving its BLOCK_N rows
            h_row = t * K + offs_k
            acc8 = tl.zeros([KP * BLOCK_N], dtype=tl.float32)
            for r4 in range(0, I, BLOCK_R):
                if DOWN_FMT == 12:
                    acc8 += q4k_rows_int8(d_u8, d_f16, rows, row_ok, h_ptr, h_row, ok, r4, I, BLOCK_R, BLOCK_N, DP4A,
                                           H_INT8, T * K)  # fmt: skip
                else:
                    acc8 += q6k_rows_int8(d_u8, d_f16, rows, row_ok, h_ptr, h_row, ok, r4, I, BLOCK_R, BLOCK_N, DP4A,
                                           H_INT8, T * K)  # fmt: skip
            part_sum = acc8
        else:
            acc = tl.zeros([KP * BLOCK_N, BLOCK_R // DOWN_G, DOWN_G], dtype=tl.float32)
            for r0 in range(0, I, BLOCK_R):
                c = r0 + cols
                if H_ONCE:  # each route's h loaded once, broadcast over the tile's BLOCK_N rows of that route
                    hk = tl.load(h_ptr + ((t * K + offs_k) * I)[:, None, None] + c[None, :, :],
                                 mask=ok[:, None, None] & (c < I)[None, :, :], other=0.0)
                    hv = tl.reshape(tl.broadcast_to(hk[:, None, :, :], (KP, BLOCK_N, BLOCK_R // DOWN_G, DOWN_G)),
                                    (KP * BLOCK_N, BLOCK_R // DOWN_G, DOWN_G))
                else:
                    hv = tl.load(h_ptr + h_rows[:, None, None] + c[None, :, :],
                                 mask=row_ok[:, None, None] & (c < I)[None, :, :], other=0.0)
                d = dequant_tile(d_u8, d_i8, d_f16, rows, row_ok, r0, I, DOWN_FMT, BLOCK_R, DOWN_G)
                acc += d * hv
            part_sum = tl.sum(tl.sum(acc, axis=2), axis=1)
        wrow = tl.reshape(wk[:, None] + tl.zeros([BLOCK_N], dtype=tl.float32)[None, :], [KP * BLOCK_N])
        part = part_sum * wrow
        tl.store(y_ptr + t * H + offs_n, tl.sum(tl.reshape(part, [KP, BLOCK_N]), axis=0).to(y_ptr.dtype.element_ty),
                 mask=n_ok)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_R // DOWN_G, DOWN_G], dtype=tl.float32)
        # one route after another; a skipped route's loads are masked off and its weight is 0
        for k in tl.static_range(K):
            e1 = tl.load(ids_ptr + t * K + k).to(tl.int64)
            if SLOTS:
                e1 = tl.load(table_ptr + tl.maximum(e1, 0), mask=e1 >= 0, other=-1).to(tl.int64)
            ok1 = e1 >= 0
            wk1 = tl.where(ok1, tl.load(w_ptr + t * K + k).to(tl.float32), 0.0)
            rows1 = (tl.maximum(e1, 0) * H + offs_n.to(tl.int64)) * DOWN_RB
            h_row = h_ptr + (t * K + k) * I
            for r1 in range(0, I, BLOCK_R):
                hv1 = load_groups(h_row, r1, I, BLOCK_R, DOWN_G, ok1)
                d1 = dequant_tile(d_u8, d_i8, d_f16, rows1, n_ok & ok1, r1, I, DOWN_FMT, BLOCK_R, DOWN_G)
                acc2 += d1 * (hv1 * wk1)[None, :, :]
        tl.store(y_ptr + t * H + offs_n, tl.sum(tl.sum(acc2, axis=2), axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def dequant_rows_kernel(
    u8, i8, f16, out_ptr, first_row, ROWS,
    NCOLS: tl.constexpr, FMT: tl.constexpr, RB: tl.constexpr, G: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``out[r, :] = dequant(row first_row + r)`` for ``r < ROWS``, in out's dtype."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROWS
    c0 = tl.program_id(1) * BLOCK_C
    w = dequant_tile(u8, i8, f16, (first_row + offs_r.to(tl.int64)) * RB, r_ok, c0, NCOLS, FMT, BLOCK_C, G)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    dst = out_ptr + offs_r.to(tl.int64)[:, None] * NCOLS + offs_c[None, :]
    tl.store(dst, tl.reshape(w, [BLOCK_R, BLOCK_C]).to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (offs_c < NCOLS)[None, :])


def dequantize_experts(stack: PackedStack, out: Any, first: int = 0, count: Any = None) -> Any:
    """Experts ``first .. first + count`` of ``stack`` dequantized into ``out``
    (``[count, rows, cols]``, contiguous, BF16/FP16/FP32) on the device, in one launch."""
    count = stack.data.shape[0] - first if count is None else int(count)
    if tuple(out.shape) != (count, stack.rows, stack.cols) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{count}, {stack.rows}, {stack.cols}] tensor, got {tuple(out.shape)}")
    rows = count * stack.rows
    if rows == 0:
        return out
    block_r, block_c = 16, min(256, triton.next_power_of_2(stack.cols))
    opts = triton_target.for_device(out.device).launch_options(4)
    dequant_rows_kernel[(triton.cdiv(rows, block_r), triton.cdiv(stack.cols, block_c))](
        *stack.views(), out, first * stack.rows, rows, NCOLS=stack.cols, FMT=stack.fmt, RB=stack.row_bytes,
        G=stack.group, BLOCK_R=block_r, BLOCK_C=block_c, **opts,
    )  # fmt: skip
    return out


def variant_key(x: Any, ids: Any, w: Any, y: Any, config: PackedConfig = DEFAULT_CONFIG,
                table: Any = None) -> tuple[Any, ...]:  # fmt: skip
    """What selects the compiled variant of a launch beyond the stacks' fixed formats and
    shapes: the config, the route count K, argument dtypes, whether ids go through a slot
    table, and 16-byte pointer alignment (the token count is not specialised). Equal keys:
    no new compilation."""
    return (config, ids.shape[1], x.dtype, ids.dtype, w.dtype, y.dtype, table is not None,
            tuple(t.data_ptr() % 16 == 0 for t in (x, ids, w, y)))


def launch(
    x: Any, ids: Any, w: Any, gate: PackedStack, up: PackedStack, down: PackedStack, y: Any, h: Any,
    activation: str, config: PackedConfig = DEFAULT_CONFIG, alpha: float = 1.702, limit: float = 7.0,
    table: Any = None,
) -> None:  # fmt: skip
    """``y [T, H]`` (contiguous, overwritten) = the routed experts' output, summed in float32
    and stored once in y's dtype (float32, bfloat16 or float16). With ``table`` (int32
    ``[n]``, contiguous) the ids are not this stack's experts but indices into it: route
    ``(t, k)`` runs expert ``table[ids[t, k]]``, none where that is -1 (an expert cache's
    slots, read by the kernels, so a captured graph follows changes to the table).

    ``x [T, H]`` (any float dtype), ``ids [T, K]`` (int32/int64, -1 = skip), ``w [T, K]``,
    all contiguous; ``gate/up`` stacks of ``[E, I, H]``, ``down`` of ``[E, H, I]``; ``h
    [T, K, I]`` float32 scratch (contents need not be initialised). Any batch size runs;
    the weights are read once per route, so large batches are better served dequantized."""
    import torch

    tokens, top_k = ids.shape
    inter, hidden = gate.rows, gate.cols
    if (up.rows, up.cols) != (inter, hidden) or (down.rows, down.cols) != (hidden, inter):
        raise ValueError(
            f"packed stacks: gate [{gate.rows}, {gate.cols}], up [{up.rows}, {up.cols}], "
            f"down [{down.rows}, {down.cols}]: expected [I, H], [I, H], [H, I]"
        )
    if y.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not y.is_contiguous() or tuple(y.shape) != (tokens, hidden):
        raise ValueError(f"y must be a contiguous float32/bfloat16/float16 [{tokens}, {hidden}] tensor, "
                         f"got {y.dtype} {tuple(y.shape)}")
    if h.dtype != torch.float32 or not h.is_contiguous() or h.numel() < tokens * top_k * inter:
        raise ValueError(f"h must be a contiguous float32 tensor of >= {tokens * top_k * inter} values")
    if not (ids.is_contiguous() and w.is_contiguous() and x.is_contiguous()):
        raise ValueError("x, ids and w must be contiguous")
    if table is not None and (table.dtype != torch.int32 or not table.is_contiguous()):
        raise ValueError(f"table must be a contiguous int32 tensor, got {table.dtype}")
    if tokens == 0:
        return
    config = for_target(config, x.device)
    launch_gate_up(x, ids, gate, up, h, activation, config, alpha, limit, table, quantized_h(config, down.fmt))
    launch_down(h, ids, w, down, y, config, table)


def int8_dots_run_on(device: Any) -> bool:
    """Whether ``int8_dot`` configs keep their int8 dots on ``device``: on NVIDIA (the ``dp4a``
    instruction) and in Triton's interpreter (the same sums from byte extractions, for the
    tests). Elsewhere (AMD) the byte tiles run: the byte-extraction form has no measured gain
    there, and Triton's AMD backend spent over 10 minutes compiling its Q6_K down kernel."""
    return triton_target.for_device(device).backend in ("cuda", "none")


def for_target(config: PackedConfig, device: Any) -> PackedConfig:
    """``config`` as it runs on ``device``: without int8 dots where they do not
    (:func:`int8_dots_run_on`)."""
    if config.int8_dot and not int8_dots_run_on(device):
        return dataclasses.replace(config, int8_dot=False, int8_h=False)
    return config


#: The byte tiles' float32 accumulator values per thread (``block_i * block_h / (32 *
#: num_warps)``, for each of gate and up) that the gate/up kernel may hold. Compiled for
#: sm_90 (ptxas of the installed Triton), Q5_K, Q6_K, Q8_0 and MXFP4 rows spill registers to
#: local memory at 64 (MXFP4: 416 B a thread at 2 x 2048 with 2 warps, 2744 B at 16 x 1024 with
#: 8) and at NVIDIA_CONFIG's 256 (16 x 2048 with 4 warps: 14 KB a thread, ~4 ms per decode layer
#: of GPT-OSS-120B, whose gate/up weights take ~12 us to read), and none at 32 in every tile tried
#: (tests/gpu/packed_sm90_spills.py). The down kernel's byte tiles likewise
#: (:func:`down_tiles`).
BYTE_TILE_VALUES = 32


def capped_byte_tiles(rows: int, step: int, warps: int, narrowest: int) -> tuple[int, int]:
    """``(step, warps)`` of a byte tile of ``rows`` rows by ``step`` values holding at most
    :data:`BYTE_TILE_VALUES` accumulator values per thread: the warps doubled up to 8, then
    the step halved down to ``narrowest`` (as far as that goes)."""
    while rows * step > BYTE_TILE_VALUES * 32 * warps:
        if warps < 8:
            warps *= 2
        elif step > narrowest:
            step //= 2
        else:
            break
    return step, warps


def gate_up_tiles(config: PackedConfig, gate_fmt: int, up_fmt: int, backend: str) -> PackedConfig:
    """``config`` as the gate/up kernel runs it on a Triton ``backend`` (``cuda``, ``hip``,
    ...: :mod:`freetoken.backends.triton_target`): as given where its int8 dots run (Q4_K gate
    and up) and off NVIDIA GPUs; else (the byte tiles on NVIDIA) with at most
    :data:`BYTE_TILE_VALUES` accumulator values per thread: more warps (up to 8), then
    narrower steps over the hidden columns. ``block_i`` is kept (the grid, and ``h``'s int8
    groups of 16)."""
    if backend != "cuda":
        return config
    if config.int8_dot and gate_fmt == FMT_Q4_K and up_fmt == FMT_Q4_K:
        return config
    narrowest = max(32, FORMATS[gate_fmt][2], FORMATS[up_fmt][2])  # whole groups of the formats
    block_h, warps = capped_byte_tiles(config.block_i, config.block_h, config.num_warps, narrowest)
    if (block_h, warps) == (config.block_h, config.num_warps):
        return config
    return dataclasses.replace(config, block_h=block_h, num_warps=warps)


def down_tiles(config: PackedConfig, down_fmt: int, top_k: int, backend: str) -> PackedConfig:
    """``config`` as the down kernel runs it on a Triton ``backend``: as given where its int8
    dots run (the routes tile over Q4_K or Q6_K rows) and off NVIDIA GPUs; else (the byte
    tiles on NVIDIA: Q5_K, Q8_0 and MXFP4 rows spilled at Qwen3-30B-A3B's 8 routes) with at
    most :data:`BYTE_TILE_VALUES` accumulator values per thread (the routes tile holds
    ``next_power_of_2(top_k) * block_n * block_r`` of them): more warps (up to 8), then narrower
    steps over the intermediate columns. ``block_n`` is kept (the grid)."""
    if backend != "cuda":
        return config
    if config.int8_dot and config.down_routes_tile and down_fmt in (FMT_Q4_K, FMT_Q6_K):
        return config
    rows = (triton.next_power_of_2(top_k) if config.down_routes_tile else 1) * config.block_n
    warps_given = config.down_num_warps or config.num_warps
    block_r, warps = capped_byte_tiles(rows, config.block_r, warps_given, max(32, FORMATS[down_fmt][2]))
    if (block_r, warps) == (config.block_r, warps_given):
        return config
    return dataclasses.replace(config, block_r=block_r, down_num_warps=warps)


def quantized_h(config: PackedConfig, down_fmt: int) -> bool:
    """Whether the gate/up kernel leaves ``h`` quantized to int8 per 16 values for the down
    kernel (``int8_h``, and a down format and form the int8 dots serve) rather than in
    float32, which the down kernel's programs would each quantize again."""
    return (config.int8_dot and config.int8_h and config.down_routes_tile and config.block_i % 16 == 0
            and down_fmt in (FMT_Q4_K, FMT_Q6_K))  # fmt: skip


def launch_gate_up(
    x: Any, ids: Any, gate: PackedStack, up: PackedStack, h: Any, activation: str,
    config: PackedConfig = DEFAULT_CONFIG, alpha: float = 1.702, limit: float = 7.0, table: Any = None,
    h_int8: bool = False,
) -> None:  # fmt: skip
    """The first of :func:`launch`'s two kernels alone (``h`` from ``x``; with ``h_int8``,
    :func:`quantized_h` of the down stack, quantized in ``h``'s buffer); no checks."""
    tokens, top_k = ids.shape
    config = for_target(config, x.device)
    h_int8 = h_int8 and config.int8_dot  # where int8 dots do not run, neither does the down kernel read codes
    target = triton_target.for_device(x.device)
    config = gate_up_tiles(config, gate.fmt, up.fmt, target.backend)
    opts = target.launch_options(config.num_warps, config.num_stages)
    _gate_up_packed_kernel[(tokens * top_k, triton.cdiv(gate.rows, config.block_i))](
        x, ids, ids if table is None else table, *gate.views(), *up.views(), h, tokens, K=top_k, H=gate.cols, I=gate.rows,
        GATE_FMT=gate.fmt, GATE_RB=gate.row_bytes, GATE_G=gate.group,
        UP_FMT=up.fmt, UP_RB=up.row_bytes, UP_G=up.group,
        ACT=ACT_CODES[activation], ALPHA=float(alpha), LIMIT=float(limit),
        BLOCK_I=config.block_i, BLOCK_H=config.block_h, SLOTS=table is not None,
        INT8=config.int8_dot, DP4A=config.int8_dot and target.backend == "cuda", H_INT8=h_int8, **opts,
    )  # fmt: skip


def launch_down(h: Any, ids: Any, w: Any, down: PackedStack, y: Any, config: PackedConfig = DEFAULT_CONFIG,
                table: Any = None) -> None:  # fmt: skip
    """The second of :func:`launch`'s two kernels alone (``y`` from ``h``); no checks."""
    tokens, top_k = ids.shape
    config = for_target(config, h.device)
    target = triton_target.for_device(h.device)
    config = down_tiles(config, down.fmt, top_k, target.backend)
    opts = target.launch_options(config.down_num_warps or config.num_warps, config.num_stages)
    _down_packed_kernel[(tokens, triton.cdiv(down.rows, config.block_n))](
        h, ids, ids if table is None else table, w, *down.views(), y, tokens, K=top_k, H=down.rows, I=down.cols,
        DOWN_FMT=down.fmt, DOWN_RB=down.row_bytes, DOWN_G=down.group,
        BLOCK_N=config.block_n, BLOCK_R=config.block_r, KP=triton.next_power_of_2(top_k),
        ROUTES_TILE=config.down_routes_tile, SLOTS=table is not None,
        H_ONCE=config.down_h_once, INT8=config.int8_dot and config.down_routes_tile,
        DP4A=config.int8_dot and target.backend == "cuda", H_INT8=quantized_h(config, down.fmt), **opts,
    )  # fmt: skip
