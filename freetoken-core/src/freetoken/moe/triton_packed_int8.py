"""Integer dot products of packed K-quant rows with activations quantized to int8.

The byte tiles of :mod:`freetoken.moe.triton_moe_packed` dequantize every weight to float32
before its product: a dozen integer and conversion instructions per value, so the one-token
kernels are bound by instruction issue, not by memory. Here the activations are quantized
once per 32 values and the weights' codes stay integers, four to a 32-bit word, multiplied
four at a time (``dp4a``: four int8 products summed into an int32 in one instruction):

* activations: per group of 32 values ``q = floor(x * 127 / amax + 1/2)`` in -127..127,
  scale ``dx = amax / 127``, kept as words of four codes (value ``4w + b`` in byte ``b`` of
  word ``w``) with the group's sum ``dx * sum(q)`` (:func:`_quantize_groups`). Every result
  is the exact weights times these quantized activations ``dx * q``. The CPU kernels of
  freetoken-cpu-moe multiply K-quant weights with int8 activations too.
* Q4_K rows (:func:`_dot_q4k_int8`): per 32-value sub-block ``d*sc * dx * sum(q*xq) -
  dmin*m * dx * sum(xq)``; the nibbles read as 32-bit words (blocks of 144 bytes keep rows
  4-byte aligned), low and high nibbles of a word masked out four at a time.
* Q6_K rows (:func:`_dot_q6k_int8`): per 16 values ``d*sc * dx * (sum(q*xq) - 32 *
  sum(xq))``; its 210-byte blocks align to 2 bytes only, so words are put together from
  16-bit loads.

The weights are exact; the activations carry the int8 rounding (a relative error of ~1e-2
per product, ~1e-3 on a row's sum). ``dp4a`` is PTX's ``dp4a.s32.s32`` on NVIDIA; on other
targets and in Triton's interpreter (``ASM`` false) the same sums come from byte
extractions.

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Elementwise ``sum_i int8(a, byte i) * int8(b, byte i)`` (int32), ``a`` and ``b`` int32
    words of four signed bytes, broadcast to one shape."""
    a, b = tl.broadcast(a, b)
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = tl.zeros_like(a)
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def _quantize_groups(x_ptr, x_off, x_ok, grp, g_ok):
    """Activations ``x_ptr[x_off[a] + 32 * grp[n] + c]`` (``c < 32``) quantized per group:
    ``(words [A, N, 8] int32, scale [A, N], sum [A, N])``, the sum that of the quantized
    values (scale times the codes' sum), float32; masked groups are zero."""
    offs = ((grp.to(tl.int64) * 32)[None, :, None, None] + (tl.arange(0, 8) * 4)[None, None, :, None]
            + tl.arange(0, 4)[None, None, None, :])  # fmt: skip
    m = (x_ok[:, None] & g_ok[None, :])[:, :, None, None]
    xf = tl.load(x_ptr + x_off[:, None, None, None] + offs, mask=m, other=0.0).to(tl.float32)  # [A, N, 8, 4]
    amax = tl.max(tl.max(tl.abs(xf), axis=3), axis=2)  # [A, N]
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    q = tl.floor(xf * inv[:, :, None, None] + 0.5).to(tl.int32)
    words = tl.sum((q & 255) << (tl.arange(0, 4) * 8)[None, None, None, :], axis=3)
    scale = amax / 127.0
    return words, scale, scale * tl.sum(tl.sum(q, axis=3), axis=2).to(tl.float32)


@triton.jit
def _repeat_rows(v, REP: tl.constexpr):
    """``v [A, N]`` with each row repeated ``REP`` times: ``[A * REP, N]``."""
    if REP == 1:
        return v
    else:
        return tl.reshape(tl.broadcast_to(v[:, None, :], (v.shape[0], REP, v.shape[1])), (v.shape[0] * REP, v.shape[1]))


@triton.jit
def _repeat_rows3(v, REP: tl.constexpr):
    """``v [A, N, M]`` with each row repeated ``REP`` times: ``[A * REP, N, M]``."""
    if REP == 1:
        return v
    else:
        return tl.reshape(tl.broadcast_to(v[:, None, :, :], (v.shape[0], REP, v.shape[1], v.shape[2])),
                          (v.shape[0] * REP, v.shape[1], v.shape[2]))


@triton.jit
def _words16(i16_ptr, off, m3, R: tl.constexpr, NQ: tl.constexpr):
    """``[R, NQ, 8]`` int32 words put together from 16 half-words at byte offsets ``off [R, NQ]`` (even)."""
    v = tl.load(i16_ptr + (off // 2)[:, :, None] + tl.arange(0, 16)[None, None, :], mask=m3, other=0).to(tl.int32)
    return tl.sum(tl.reshape(v & 0xFFFF, (R, NQ, 8, 2)) << (tl.arange(0, 2) * 16)[None, None, None, :], axis=3)


@triton.jit
def _dot_q4k_int8(
    u8_ptr, f16_ptr, row_off, row_ok, pg, p_ok, x_lo, d_lo, s_lo, x_hi, d_hi, s_hi, ASM: tl.constexpr,
):  # fmt: skip
    """``[R, P]`` float32: Q4_K rows (byte offsets ``row_off [R]``, multiples of 4) dotted with
    quantized activations over the pairs of sub-blocks ``pg [P]`` (pair ``pg``: sub-blocks
    ``2 pg`` and ``2 pg + 1``, values ``64 pg .. 64 pg + 63`` of a row). ``x_lo/d_lo/s_lo``:
    :func:`_quantize_groups` of groups ``2 pg``, ``x_hi...`` of ``2 pg + 1``, each with one row
    or ``R`` rows."""
    i32_ptr = u8_ptr.to(tl.pointer_type(tl.int32))
    sb = pg // 4
    p = (pg % 4)[None, :]
    m2 = row_ok[:, None] & p_ok[None, :]
    w0 = (row_off[:, None] + (sb * 144)[None, :]) // 4  # [R, P]: the block's first word
    words = tl.load(i32_ptr + (w0 + 4 + 8 * p)[:, :, None] + tl.arange(0, 8)[None, None, :], mask=m2[:, :, None],
                    other=0)  # [R, P, 8]: the pair's 32 nibble bytes
    i_lo = tl.sum(_dp4a(words & 0x0F0F0F0F, x_lo, ASM), axis=2)
    i_hi = tl.sum(_dp4a((words >> 4) & 0x0F0F0F0F, x_hi, ASM), axis=2)
    # 6-bit scales and mins (bytes 4..15 as words a, b, c; see triton_moe_packed._dequant_tile):
    # sub-block s < 4: sc = byte s of a & 63, m = byte s of b & 63; s >= 4: low 4 bits from
    # byte s - 4 of c, top 2 from the top bits of byte s - 4 of a (sc) or b (m)
    a = tl.load(i32_ptr + w0 + 1, mask=m2, other=0)
    b = tl.load(i32_ptr + w0 + 2, mask=m2, other=0)
    c = tl.load(i32_ptr + w0 + 3, mask=m2, other=0)
    sh = 16 * (p % 2)  # byte 2 (p % 2) holds sub-block 2p (p < 2) or 2p - 4 (p >= 2)
    hi = p >= 2
    sc_lo = tl.where(hi, ((c >> sh) & 15) | (((a >> (sh + 6)) & 3) << 4), (a >> sh) & 63)
    sc_hi = tl.where(hi, ((c >> (sh + 8)) & 15) | (((a >> (sh + 14)) & 3) << 4), (a >> (sh + 8)) & 63)
    m_lo = tl.where(hi, ((c >> (sh + 4)) & 15) | (((b >> (sh + 6)) & 3) << 4), (b >> sh) & 63)
    m_hi = tl.where(hi, ((c >> (sh + 12)) & 15) | (((b >> (sh + 14)) & 3) << 4), (b >> (sh + 8)) & 63)
    d = tl.load(f16_ptr + w0 * 2, mask=m2, other=0.0).to(tl.float32)
    dmin = tl.load(f16_ptr + w0 * 2 + 1, mask=m2, other=0.0).to(tl.float32)
    return (d * (sc_lo.to(tl.float32) * d_lo * i_lo.to(tl.float32) + sc_hi.to(tl.float32) * d_hi * i_hi.to(tl.float32))
            - dmin * (m_lo.to(tl.float32) * s_lo + m_hi.to(tl.float32) * s_hi))  # fmt: skip


@triton.jit
def _q4k_rows_int8(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_off, x_ok, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
    REP: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``[R]`` float32: Q4_K rows dotted with activations over columns ``c0 .. c0 + BLOCK_C``
    (a multiple of 64), the activations quantized here: rows ``x_off [A]``, each serving
    ``REP`` consecutive rows of the tile (``R = A * REP``; ``A = 1``: one row for all)."""
    pg = c0 // 64 + tl.arange(0, BLOCK_C // 64)
    p_ok = pg * 64 < NCOLS
    x_lo, d_lo, s_lo = _quantize_groups(x_ptr, x_off, x_ok, 2 * pg, p_ok)
    x_hi, d_hi, s_hi = _quantize_groups(x_ptr, x_off, x_ok, 2 * pg + 1, p_ok)
    part = _dot_q4k_int8(u8_ptr, f16_ptr, row_off, row_ok, pg, p_ok,
                         _repeat_rows3(x_lo, REP), _repeat_rows(d_lo, REP), _repeat_rows(s_lo, REP),
                         _repeat_rows3(x_hi, REP), _repeat_rows(d_hi, REP), _repeat_rows(s_hi, REP), ASM)  # fmt: skip
    return tl.sum(part, axis=1)


@triton.jit
def _q6k_rows_int8(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_off, x_ok, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
    REP: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``[R]`` float32: as :func:`_q4k_rows_int8` for Q6_K rows (byte offsets ``row_off [R]``,
    even), ``BLOCK_C`` a multiple of 128 (half super-blocks). Value ``j = 128 n + 32 k + l``
    of a block: low 4 bits in byte ``64 n + 32 (k % 2) + l`` (high nibble for ``k >= 2``),
    top 2 bits ``2k, 2k + 1`` of byte ``128 + 32 n + l``, int8 scale ``192 + j // 16``."""
    NQ: tl.constexpr = BLOCK_C // 128
    i16_ptr = u8_ptr.to(tl.pointer_type(tl.int16))
    i8_ptr = u8_ptr.to(tl.pointer_type(tl.int8))
    hq = c0 // 128 + tl.arange(0, NQ)  # half n = hq % 2 of super-block hq // 2
    q_ok = hq * 128 < NCOLS
    n = (hq % 2)[None, :]
    m2 = row_ok[:, None] & q_ok[None, :]
    m3 = m2[:, :, None]
    blk = row_off[:, None] + (hq // 2 * 210)[None, :]  # [R, NQ]
    R: tl.constexpr = row_off.shape[0]
    ql0 = _words16(i16_ptr, blk + 64 * n, m3, R, NQ)
    ql1 = _words16(i16_ptr, blk + 64 * n + 32, m3, R, NQ)
    qh = _words16(i16_ptr, blk + 128 + 32 * n, m3, R, NQ)
    ones = tl.full((1, 1, 1), 0x01010101, tl.int32)
    total = tl.zeros((R, NQ), dtype=tl.float32)
    for k in tl.static_range(4):
        ql = ql1 if k % 2 else ql0
        q = ((ql >> (4 * (k // 2))) & 0x0F0F0F0F) | (((qh >> (2 * k)) & 0x03030303) << 4)
        xw, dx, _ = _quantize_groups(x_ptr, x_off, x_ok, 4 * hq + k, q_ok)  # [A, NQ, 8], [A, NQ]
        sx = tl.sum(tl.reshape(_dp4a(xw, ones, ASM), (xw.shape[0], NQ, 2, 4)), axis=3)  # [A, NQ, 2]: sum(xq) per 16
        prod = tl.sum(tl.reshape(_dp4a(q, _repeat_rows3(xw, REP), ASM), (R, NQ, 2, 4)), axis=3)  # [R, NQ, 2]
        sc = tl.load(i8_ptr + (blk + 192 + 8 * n + 2 * k)[:, :, None] + tl.arange(0, 2)[None, None, :], mask=m3,
                     other=0).to(tl.float32)  # fmt: skip
        isum = (prod - 32 * _repeat_rows3(sx, REP)).to(tl.float32)
        total += _repeat_rows(dx, REP) * tl.sum(sc * isum, axis=2)
    d = tl.load(f16_ptr + (blk + 208) // 2, mask=m2, other=0.0).to(tl.float32)
    return tl.sum(d * total, axis=1)
