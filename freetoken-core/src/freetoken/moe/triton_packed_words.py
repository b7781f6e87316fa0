"""Dot products of packed rows with activations, the codes read as whole words.

The block decoding of :mod:`freetoken.moe.triton_moe_packed` (``_dequant_tile``) loads one
byte per value and dequantizes each value before its product. Here the codes are read
several to a load and each scale group's sum is factored, for the one-token programs of
the packed expert and dense kernels (``word_loads`` in their configs):

* Q4_K/Q5_K (:func:`_dot_words`): the nibbles as 32-bit words, 8 values per load (block
  sizes 144 and 176 bytes keep rows 4-byte aligned); per 32-value sub-block
  ``d*sc * sum(q*x) - dmin*m * sum(x)``.
* Q6_K (:func:`_dot_words_q6k`): 16-bit half-words (its 210-byte blocks align to 2 only),
  8 values per 3 loads; per 16-value group ``d*sc * sum((q - 32)*x)``.

The weights are the same values as gguf-py's; products and sums are float32 in another
order than the byte tiles', so results agree to float32 rounding.

triton is optional: import this module lazily, only when the Triton implementation is
selected.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot_words(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_off, c0, NCOLS: tl.constexpr, FMT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``[R, BLOCK_C // 64]`` float32: partial dot products of Q4_K or Q5_K rows (byte offsets
    ``row_off [R]``, a multiple of 4) with ``x_ptr[x_off[r] + c]`` over the columns ``c0 ..
    c0 + BLOCK_C``, one per pair of 32-value sub-blocks. The nibbles are read as 32-bit
    words (8 values per load instead of one byte per value) and each pair's sums are
    ``d*sc * sum(q*x) - dmin*m * sum(x)``, the dequantization's arithmetic factored."""
    P: tl.constexpr = BLOCK_C // 64
    i32_ptr = u8_ptr.to(tl.pointer_type(tl.int32))
    pg = c0 // 64 + tl.arange(0, P)  # pair of sub-blocks 2p, 2p+1 of super-block sb
    p_ok = pg * 64 < NCOLS
    sb = pg // 4
    p = pg % 4
    m2 = row_ok[:, None] & p_ok[None, :]
    m3 = m2[:, :, None]
    blk = row_off[:, None] + (sb * (144 + 32 * (FMT - 12)))[None, :]  # [R, P] block byte offsets
    offs_w = tl.arange(0, 8)
    q_word = (blk + (16 + 32 * (FMT - 12) + 32 * p)[None, :]) // 4
    words = tl.load(i32_ptr + q_word[:, :, None] + offs_w[None, None, :], mask=m3, other=0)  # [R, P, 8]
    if FMT == 13:  # fifth bits: bit s of byte 16 + l, l = 4 * word + byte
        hwords = tl.load(i32_ptr + ((blk + 16) // 4)[:, :, None] + offs_w[None, None, :], mask=m3, other=0)
        hshift = (2 * p)[None, :, None]
    xo = x_off[:, None, None] + (pg * 64)[None, :, None] + offs_w[None, None, :] * 4  # value 4w of sub-block 2p
    acc_lo = tl.zeros(words.shape, dtype=tl.float32)
    acc_hi = tl.zeros(words.shape, dtype=tl.float32)
    sx_lo = tl.zeros(words.shape, dtype=tl.float32)
    sx_hi = tl.zeros(words.shape, dtype=tl.float32)
    for b in tl.static_range(4):
        x_lo = tl.load(x_ptr + xo + b, mask=m3, other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + xo + (32 + b), mask=m3, other=0.0).to(tl.float32)
        q_lo = (words >> (8 * b)) & 15
        q_hi = (words >> (8 * b + 4)) & 15
        if FMT == 13:
            q_lo = q_lo | (((hwords >> (hshift + 8 * b)) & 1) << 4)
            q_hi = q_hi | (((hwords >> (hshift + (8 * b + 1))) & 1) << 4)
        acc_lo += q_lo.to(tl.float32) * x_lo
        acc_hi += q_hi.to(tl.float32) * x_hi
        sx_lo += x_lo
        sx_hi += x_hi
    # 6-bit scales and mins of sub-blocks s = 2p and 2p + 1 (see _dequant_tile)
    s4 = ((2 * p) % 4)[None, :]
    a0 = tl.load(u8_ptr + blk + 4 + s4, mask=m2, other=0).to(tl.int32)
    a1 = tl.load(u8_ptr + blk + 5 + s4, mask=m2, other=0).to(tl.int32)
    b0 = tl.load(u8_ptr + blk + 8 + s4, mask=m2, other=0).to(tl.int32)
    b1 = tl.load(u8_ptr + blk + 9 + s4, mask=m2, other=0).to(tl.int32)
    c0b = tl.load(u8_ptr + blk + 12 + s4, mask=m2, other=0).to(tl.int32)
    c1b = tl.load(u8_ptr + blk + 13 + s4, mask=m2, other=0).to(tl.int32)
    hi = (p >= 2)[None, :]
    sc_lo = tl.where(hi, (c0b & 15) | ((a0 >> 6) << 4), a0 & 63).to(tl.float32)
    sc_hi = tl.where(hi, (c1b & 15) | ((a1 >> 6) << 4), a1 & 63).to(tl.float32)
    mn_lo = tl.where(hi, (c0b >> 4) | ((b0 >> 6) << 4), b0 & 63).to(tl.float32)
    mn_hi = tl.where(hi, (c1b >> 4) | ((b1 >> 6) << 4), b1 & 63).to(tl.float32)
    d = tl.load(f16_ptr + blk // 2, mask=m2, other=0.0).to(tl.float32)
    dmin = tl.load(f16_ptr + blk // 2 + 1, mask=m2, other=0.0).to(tl.float32)
    return (d * (sc_lo * tl.sum(acc_lo, axis=2) + sc_hi * tl.sum(acc_hi, axis=2))
            - dmin * (mn_lo * tl.sum(sx_lo, axis=2) + mn_hi * tl.sum(sx_hi, axis=2)))


@triton.jit
def _dot_words_q6k(
    u8_ptr, f16_ptr, row_off, row_ok, x_ptr, x_off, c0, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``[R, BLOCK_C // 128]`` float32: as :func:`_dot_words` for Q6_K rows (byte offsets
    ``row_off [R]``, even), one sum per half super-block of 128 values. Q6_K blocks are 210
    bytes, so only 16-bit loads are aligned: 16 half-words each of the low-nibble rows and the
    high-bit row give a half's 128 values (8 per 3 loads, instead of one byte per value)."""
    NQ: tl.constexpr = BLOCK_C // 128
    i16_ptr = u8_ptr.to(tl.pointer_type(tl.int16))
    hq = c0 // 128 + tl.arange(0, NQ)  # half n = hq % 2 of super-block hq // 2
    q_ok = hq * 128 < NCOLS
    n = hq % 2
    m2 = row_ok[:, None] & q_ok[None, :]
    m3 = m2[:, :, None]
    blk = row_off[:, None] + (hq // 2 * 210)[None, :]
    offs_u = tl.arange(0, 16)  # half-word u: values l = 2u (low byte) and 2u + 1 (high byte)
    h0 = (blk + (64 * n)[None, :]) // 2
    ql0 = tl.load(i16_ptr + h0[:, :, None] + offs_u[None, None, :], mask=m3, other=0).to(tl.int32) & 0xFFFF
    ql1 = tl.load(i16_ptr + (h0 + 16)[:, :, None] + offs_u[None, None, :], mask=m3, other=0).to(tl.int32) & 0xFFFF
    qh = tl.load(i16_ptr + ((blk + (128 + 32 * n)[None, :]) // 2)[:, :, None] + offs_u[None, None, :], mask=m3,
                 other=0).to(tl.int32) & 0xFFFF
    xo = x_off[:, None, None] + (hq * 128)[None, :, None] + 2 * offs_u[None, None, :]
    sc_off = blk + (192 + 8 * n)[None, :]  # int8 scales of this half: 8n + 2k + l // 16
    total = tl.zeros(qh.shape, dtype=tl.float32)
    for k in tl.static_range(4):
        ql = ql1 if k % 2 else ql0
        part = tl.zeros(qh.shape, dtype=tl.float32)
        for b in tl.static_range(2):
            lo = (ql >> (8 * b + 4 * (k // 2))) & 15
            hi = (qh >> (8 * b + 2 * k)) & 3
            xv = tl.load(x_ptr + xo + (32 * k + b), mask=m3, other=0.0).to(tl.float32)
            part += ((lo | (hi << 4)) - 32).to(tl.float32) * xv
        sc = tl.load(u8_ptr.to(tl.pointer_type(tl.int8)) + sc_off[:, :, None] + (2 * k + offs_u // 8)[None, None, :],
                     mask=m3, other=0).to(tl.float32)
        total += sc * part
    d = tl.load(f16_ptr + (blk + 208) // 2, mask=m2, other=0.0).to(tl.float32)
    return d * tl.sum(total, axis=2)
