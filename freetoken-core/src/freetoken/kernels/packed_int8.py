"""Integer dot products of packed K-quant rows with activations quantized to int8.

The byte tiles of :mod:`freetoken.kernels.moe_packed` dequantize every weight to float32
before its product: about a dozen instructions per value (Nsight Compute on the H200: 9.5
million warp instructions for the 25 million weights of a Qwen3-30B-A3B layer's gate/up at one
token, the integer pipe the busiest), so the one-token kernels are bound by instruction issue,
not by memory. Here the activations are quantized
once per 32 values and the weights' codes stay integers, four to a 32-bit word, multiplied
four at a time (``dp4a``: four int8 products summed into an int32 in one instruction):

* activations: per group of 32 values ``q = floor(x * 127 / amax + 1/2)`` in -127..127,
  scale ``dx = amax / 127``, kept as words of four codes (value ``4w + b`` in byte ``b`` of
  word ``w``) with the group's sum ``dx * sum(q)`` (:func:`_quantize_values`). Every result
  is the exact weights times these quantized activations ``dx * q``. The CPU kernels of
  freetoken-cpu-moe multiply K-quant weights with int8 activations too.
* Q4_K rows (:func:`dot_q4k_int8`, :func:`q4k_rows_int8`): per 32-value sub-block
  ``d*sc * dx * sum(q*xq) - dmin*m * dx * sum(xq)``; the nibbles read as 32-bit words
  (blocks of 144 bytes keep rows 4-byte aligned), low and high nibbles of a word masked out
  four at a time.
* Q6_K rows (:func:`q6k_rows_int8`): per 16 values ``d*sc * dx * (sum(q*xq) - 32 *
  sum(xq))``; its 210-byte blocks align to 2 bytes only, so words are put together from
  16-bit loads, and the products of each word position are chained through ``dp4a``'s
  accumulator (no reduction across threads).
* ``h`` between the expert kernels (:func:`store_quantized`): a gate/up program that
  computes whole groups of 16 values of ``h`` stores them quantized per 16 values, and the
  down kernel loads the codes instead of quantizing ``h`` again in each of its programs.

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
def _dp4a(a, b, c, ASM: tl.constexpr):
    """Elementwise ``c + sum_i int8(a, byte i) * int8(b, byte i)`` (int32): ``a`` int32 words
    of four signed bytes, ``b`` and ``c`` int32 words or scalars broadcast to its shape."""
    b = b + tl.zeros_like(a)
    c = c + tl.zeros_like(a)
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def _quantize_values(xf):
    """``xf [A, N, W, 4]`` float32 (``N`` groups of ``4 W`` values per row) quantized per group:
    ``(words [A, N, W] int32, scale [A, N], sum [A, N])``, the sum that of the quantized
    values (scale times the codes' sum); groups of zeros have scale 0."""
    amax = tl.max(tl.max(tl.abs(xf), axis=3), axis=2)  # [A, N]
    # a correctly rounded division (``/`` is an approximate one on NVIDIA): 16-bit activations make
    # exact ties of x * 127 / amax common, and a factor an ulp off rounds them the other way
    inv = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
    # one rounding of x * inv + 1/2 where the kernels are compiled (an fma, as the compiler would
    # contract it anyway; the interpreter rounds the product and the sum)
    q = tl.floor(tl.fma(xf, inv[:, :, None, None], tl.full(xf.shape, 0.5, tl.float32))).to(tl.int32)
    words = tl.sum((q & 255) << (tl.arange(0, 4) * 8)[None, None, None, :], axis=3)
    scale = amax * (1.0 / 127.0)
    return words, scale, scale * tl.sum(tl.sum(q, axis=3), axis=2).to(tl.float32)


@triton.jit
def x_groups(x_ptr, x_row, x_ok, grp, g_ok, NCOLS: tl.constexpr, PRE: tl.constexpr, ROWS):
    """The activation groups ``grp [N]`` (32 values each) of the rows ``x_row [A]`` as
    ``(words [A, N, 8], scales [A, N, S], sum [A, N])`` (masked ones zero): quantized here per
    32 values (``S = 1``) from float rows ``x_ptr[row * NCOLS + c]``, or with ``PRE`` loaded
    as :func:`store_quantized` left them in the buffer at ``x_ptr`` (``ROWS`` rows), one scale
    per 16 values (``S = 2``)."""
    m2 = x_ok[:, None] & g_ok[None, :]
    if PRE:
        row = x_row.to(tl.int64)[:, None]
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + (row * (NCOLS // 4) + grp[None, :] * 8)[:, :, None]
                        + tl.arange(0, 8)[None, None, :], mask=m2[:, :, None], other=0)  # fmt: skip
        half = (row * (NCOLS // 16) + grp[None, :] * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]  # [A, N, 2]
        scales = x_ptr + ROWS.to(tl.int64) * (NCOLS // 4)
        sums = tl.load(scales + ROWS.to(tl.int64) * (NCOLS // 16) + half, mask=m2[:, :, None], other=0.0)
        return words, tl.load(scales + half, mask=m2[:, :, None], other=0.0), tl.sum(sums, axis=2)
    else:
        offs = ((grp.to(tl.int64) * 32)[None, :, None, None] + (tl.arange(0, 8) * 4)[None, None, :, None]
                + tl.arange(0, 4)[None, None, None, :])  # fmt: skip
        xf = tl.load(x_ptr + (x_row.to(tl.int64) * NCOLS)[:, None, None, None] + offs, mask=m2[:, :, None, None],
                     other=0.0).to(tl.float32)  # fmt: skip
        words, scale, total = _quantize_values(xf)
        return words, scale[:, :, None], total


@triton.jit
def store_quantized(x_ptr, row, ROWS, NCOLS: tl.constexpr, c0, v):
    """Values ``v [B]`` (``B`` a multiple of 16; zero past ``NCOLS``) of columns ``c0 .. c0 +
    B`` of row ``row`` quantized per 16 values into the buffer at ``x_ptr`` (float32, >=
    ``ROWS * NCOLS * 3 / 8`` values): words of the codes ``[ROWS, NCOLS / 4]`` (int32), then
    scales and sums ``[ROWS, NCOLS / 16]``, as :func:`x_groups` loads them with ``PRE``."""
    B: tl.constexpr = v.shape[0]
    words, scale, total = _quantize_values(tl.reshape(v, (1, B // 16, 4, 4)))
    g = c0 // 16 + tl.arange(0, B // 16)
    g_ok = g * 16 < NCOLS
    base = row.to(tl.int64) * (NCOLS // 16) + g  # [B / 16]
    tl.store(x_ptr.to(tl.pointer_type(tl.int32)) + (base * 4)[:, None] + tl.arange(0, 4)[None, :],
             tl.reshape(words, (B // 16, 4)), mask=g_ok[:, None])
    scales = x_ptr + ROWS.to(tl.int64) * (NCOLS // 4)
    tl.store(scales + base, tl.reshape(scale, (B // 16,)), mask=g_ok)
    tl.store(scales + ROWS.to(tl.int64) * (NCOLS // 16) + base, tl.reshape(total, (B // 16,)), mask=g_ok)


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
def _words16(i16_ptr, hw, m):
    """int32 words put together from the half-words ``hw`` (low) and ``hw + 1`` (high):
    ``hw`` a tensor of half-word indices, ``m`` its mask."""
    lo = tl.load(i16_ptr + hw, mask=m, other=0).to(tl.int32) & 0xFFFF
    return lo | (tl.load(i16_ptr + hw + 1, mask=m, other=0).to(tl.int32) << 16)


@triton.jit
def _quarters(w):
    """``w [A, N, 8]`` (words ``4 h + u`` of a group) as four ``[A, N, 2]`` tensors, one per ``u``."""
    w5 = tl.reshape(w, (w.shape[0], w.shape[1], 2, 2, 2))  # [A, N, h, u // 2, u % 2]
    even, odd = tl.split(w5)
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def dot_q4k_int8(
    u8_ptr, f16_ptr, row_off, row_ok, pg, p_ok, x_lo, d_lo, s_lo, x_hi, d_hi, s_hi, ASM: tl.constexpr,
):  # fmt: skip
    """``[R, P]`` float32: Q4_K rows (byte offsets ``row_off [R]``, multiples of 4) dotted with
    quantized activations over the pairs of sub-blocks ``pg [P]`` (pair ``pg``: sub-blocks
    ``2 pg`` and ``2 pg + 1``, values ``64 pg .. 64 pg + 63`` of a row). ``x_lo/d_lo/s_lo``:
    :func:`x_groups` of groups ``2 pg`` (scales ``[., P, S]``, one per ``32 / S`` values),
    ``x_hi...`` of ``2 pg + 1``, each with one row or ``R`` rows."""
    i32_ptr = u8_ptr.to(tl.pointer_type(tl.int32))
    sb = pg // 4
    p = (pg % 4)[None, :]
    m2 = row_ok[:, None] & p_ok[None, :]
    w0 = (row_off[:, None] + (sb * 144)[None, :]) // 4  # [R, P]: the block's first word
    words = tl.load(i32_ptr + (w0 + 4 + 8 * p)[:, :, None] + tl.arange(0, 8)[None, None, :], mask=m2[:, :, None],
                    other=0)  # [R, P, 8]: the pair's 32 nibble bytes
    R: tl.constexpr = row_off.shape[0]
    P: tl.constexpr = pg.shape[0]
    S: tl.constexpr = d_lo.shape[2]
    # sums per scale of the activations: S of them per sub-block, each over 8 / S words
    i_lo = tl.sum(tl.reshape(_dp4a(words & 0x0F0F0F0F, x_lo, 0, ASM), (R, P, S, 8 // S)), axis=3).to(tl.float32)
    i_hi = tl.sum(tl.reshape(_dp4a((words >> 4) & 0x0F0F0F0F, x_hi, 0, ASM), (R, P, S, 8 // S)), axis=3).to(tl.float32)
    # 6-bit scales and mins (bytes 4..15 as words a, b, c; see moe_packed.dequant_tile):
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
    return (d * (sc_lo.to(tl.float32) * tl.sum(d_lo * i_lo, axis=2) + sc_hi.to(tl.float32) * tl.sum(d_hi * i_hi, axis=2))
            - dmin * (m_lo.to(tl.float32) * s_lo + m_hi.to(tl.float32) * s_hi))  # fmt: skip


@triton.jit
def q4k_rows_int8(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_row, x_ok, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
    REP: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr, ROWS,
):  # fmt: skip
    """``[R]`` float32: Q4_K rows dotted with activations over columns ``c0 .. c0 + BLOCK_C``
    (a multiple of 64): activation rows ``x_row [A]`` (:func:`x_groups`: quantized here, or
    with ``PRE`` already), each serving ``REP`` consecutive rows of the tile (``R = A *
    REP``; ``A = 1``: one row for all)."""
    pg = c0 // 64 + tl.arange(0, BLOCK_C // 64)
    p_ok = pg * 64 < NCOLS
    x_lo, d_lo, s_lo = x_groups(x_ptr, x_row, x_ok, 2 * pg, p_ok, NCOLS, PRE, ROWS)
    x_hi, d_hi, s_hi = x_groups(x_ptr, x_row, x_ok, 2 * pg + 1, p_ok, NCOLS, PRE, ROWS)
    part = dot_q4k_int8(u8_ptr, f16_ptr, row_off, row_ok, pg, p_ok,
                         _repeat_rows3(x_lo, REP), _repeat_rows3(d_lo, REP), _repeat_rows(s_lo, REP),
                         _repeat_rows3(x_hi, REP), _repeat_rows3(d_hi, REP), _repeat_rows(s_hi, REP), ASM)  # fmt: skip
    return tl.sum(part, axis=1)


@triton.jit
def q6k_rows_int8(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_row, x_ok, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
    REP: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr, ROWS,
):  # fmt: skip
    """``[R]`` float32: as :func:`q4k_rows_int8` for Q6_K rows (byte offsets ``row_off [R]``,
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
    # [R, NQ, 2]: half-word index of word u = 4 h of each 16-value half h of a 32-byte run (word
    # u + 4 h: l = 16 h + 4 u .. + 3); the words of one u are chained through dp4a, no reduction
    h8 = (8 * tl.arange(0, 2))[None, None, :]
    ql_hw = ((blk + 64 * n) // 2)[:, :, None] + h8
    qh_hw = ((blk + 128 + 32 * n) // 2)[:, :, None] + h8
    total = tl.zeros(m2.shape, dtype=tl.float32)
    for k in tl.static_range(4):
        xw, dx, _ = x_groups(x_ptr, x_row, x_ok, 4 * hq + k, q_ok, NCOLS, PRE, ROWS)  # [A, NQ, 8], [A, NQ, S]
        x0, x1, x2, x3 = _quarters(xw)
        prod = tl.zeros(ql_hw.shape, dtype=tl.int32)  # [R, NQ, 2]
        sx = tl.zeros(x0.shape, dtype=tl.int32)  # sum(xq) per 16
        for u in tl.static_range(4):
            xu = x0 if u == 0 else (x1 if u == 1 else (x2 if u == 2 else x3))
            ql = _words16(i16_ptr, ql_hw + (16 * (k % 2) + 2 * u), m3)
            qh = _words16(i16_ptr, qh_hw + 2 * u, m3)
            q = ((ql >> (4 * (k // 2))) & 0x0F0F0F0F) | (((qh >> (2 * k)) & 0x03030303) << 4)
            prod = _dp4a(q, _repeat_rows3(xu, REP), prod, ASM)
            sx = _dp4a(xu, 0x01010101, sx, ASM)
        sc = tl.load(i8_ptr + (blk + 192 + 8 * n + 2 * k)[:, :, None] + tl.arange(0, 2)[None, None, :], mask=m3,
                     other=0).to(tl.float32)  # fmt: skip
        isum = (prod - 32 * _repeat_rows3(sx, REP)).to(tl.float32)
        total += tl.sum(_repeat_rows3(dx, REP) * sc * isum, axis=2)
    d = tl.load(f16_ptr + (blk + 208) // 2, mask=m2, other=0.0).to(tl.float32)
    return tl.sum(d * total, axis=1)
