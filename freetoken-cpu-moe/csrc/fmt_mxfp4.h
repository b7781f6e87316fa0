// GGUF MXFP4 weights (ggml block_mxfp4: one E8M0 exponent byte e, then 16 bytes of
// 4-bit E2M1 codes; element j < 16 is the low nibble of byte j, element j + 16 its
// high nibble) against int8 activations (ACT_Q8_32, a float scale per 32, the same
// blocks as Q8_0). Value of a code c: kMxfp4Values[c] * 2^(e - 128) (ggml's doubled
// E2M1 values with half the E8M0 scale). Exponents 0 and 1 (2^-128, 2^-127, float32
// subnormals) count as zero, like every subnormal under the kernels' FTZ/DAZ.
// Per block: int32 sum of value x activation code, times 2^(e - 128) x activation
// scale in float32 (the weight scale is a power of two: that product is exact).
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

static constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as float32 (0 for e < 2).
static inline float mxfp4_scale(uint8_t e) { return e >= 2 ? bits_to_float((uint32_t)(e - 1) << 23) : 0.0f; }

static inline float mxfp4_row_portable(const uint8_t* row, const ActQ8x32View& x, uint32_t nb) {
    float acc = 0.0f;
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + (size_t)b * MXFP4_BYTES;
        const int8_t* xq = x.qs + (size_t)b * 32;
        int32_t s = 0;
        for (int j = 0; j < 16; ++j)
            s += kMxfp4Values[p[1 + j] & 15] * (int32_t)xq[j] + kMxfp4Values[p[1 + j] >> 4] * (int32_t)xq[16 + j];
        acc += mxfp4_scale(p[0]) * x.d[b] * (float)s;
    }
    return acc;
}

#if defined(FT_HAVE_AVX512)
#ifndef FT_MXFP4_PREFETCH
#define FT_MXFP4_PREFETCH 2176  // bytes ahead: eight groups of 16 blocks
#endif
// NT tokens against one row, in groups of 16 blocks (4 quads of 4). Per quad one register
// holds the 4 blocks' 16 code bytes in its 4 128-bit lanes (one broadcast load each); its
// low and high nibbles (elements 0-15 and 16-31 of each block), looked up with vpshufb as
// value + 128 (unsigned), meet the token's codes of the same elements in two dpbusd into
// one int32 register, whose 128-bit lane i sums block i of the quad. The token's codes are
// rearranged once per call (Mxfp4Act: per quad the four low halves, then the four high
// halves, so each is one plain load). The four quads' registers are reduced to one (dword
// 4i + j = block 4j + i), converted once and scaled per lane by (weight scale x activation
// scale); the activation scales are stored in that order, and the exponents land in it
// directly: block i of a quad starts at byte 17 i = 16 i + i, i.e. byte i of 128-bit lane
// i of a 64-byte load at the quad's start, which one masked vpshufb per quad moves to
// dword 4i + j. The 128 * sum(x) excess of the + 128 codes is removed through
// dq = d * sum(qs), as for Q8_0. The last group of a row (fewer than 16 blocks) masks its
// weight loads and gathers its exponents; the prepared activations are zero past the
// row's last block.
struct Mxfp4Act {
    const int8_t* qs;  // [groups * 16 blocks][32]: per quad, 4 x 16 low-half codes, then 4 x 16 high-half codes
    const float* d;    // [groups * 16]: per group, dword 4i + j = block 4j + i; 0 past the last block
    const float* dq;   // the same order
};
static inline size_t mxfp4_act_bytes(uint32_t nb) { return (size_t)((nb + 15) / 16 * 16) * 40; }

static inline Mxfp4Act mxfp4_prepare_act(const ActQ8x32View& x, uint32_t nb, uint8_t* buf) {
    const uint32_t nbp = (nb + 15) / 16 * 16;
    int8_t* qs = (int8_t*)buf;
    float* d = (float*)(buf + (size_t)nbp * 32);
    float* dq = d + nbp;
    for (uint32_t b = 0; b < nbp; b += 4) {
        const uint32_t nq = b < nb ? (nb - b < 4 ? nb - b : 4) : 0;  // real blocks of this quad
        const __mmask64 k0 = nq >= 2 ? ~(__mmask64)0 : (nq == 1 ? (__mmask64)0xffffffffu : (__mmask64)0);
        const __mmask64 k1 = nq == 4 ? ~(__mmask64)0 : (nq == 3 ? (__mmask64)0xffffffffu : (__mmask64)0);
        const int8_t* src = x.qs + (size_t)(nq ? b : 0) * 32;
        const __m512i x0 = _mm512_maskz_loadu_epi8(k0, src), x1 = _mm512_maskz_loadu_epi8(k1, src + 64);
        _mm512_storeu_si512(qs + (size_t)b * 32, _mm512_shuffle_i32x4(x0, x1, 0x88));
        _mm512_storeu_si512(qs + (size_t)b * 32 + 64, _mm512_shuffle_i32x4(x0, x1, 0xDD));
    }
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (uint32_t g = 0; g < nbp; g += 16) {
        const uint32_t m = nb - g < 16 ? nb - g : 16;
        const __mmask16 mk = (__mmask16)((1u << m) - 1u);
        _mm512_storeu_ps(d + g, _mm512_permutexvar_ps(perm, _mm512_maskz_loadu_ps(mk, x.d + g)));
        _mm512_storeu_ps(dq + g, _mm512_permutexvar_ps(perm, _mm512_maskz_loadu_ps(mk, x.dq + g)));
    }
    return Mxfp4Act{qs, d, dq};
}

static inline __m512i mxfp4_sum_quads(const __m512i* s) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// The 16 doubled E2M1 values biased by 128 (unsigned for vpdpbusd; the bias is taken back
// through the activations' code sums, ``corr``), in a register's four lanes.
static inline __m512i mxfp4_lut() {
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132, (char)134,
                                                (char)136, (char)140, (char)128, (char)127, (char)126, (char)125,
                                                (char)124, (char)122, (char)120, (char)116));
}

// Quad q of a group at block b: its 4 blocks' code bytes z (block i in lane i) against each
// token's int8 codes, into s[j][q].
template <int NT>
static inline void mxfp4_quad_dots(__m512i z, const __m512i lut, const Mxfp4Act* x, uint32_t b, uint32_t q,
                                   __m512i (*s)[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i wlo = _mm512_shuffle_epi8(lut, _mm512_and_si512(z, m4));
    const __m512i whi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
    for (int j = 0; j < NT; ++j) {
        const int8_t* xq = x[j].qs + (size_t)(b + 4 * q) * 32;
        s[j][q] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo, _mm512_loadu_si512(xq)), whi,
                                      _mm512_loadu_si512(xq + 64));
    }
}

// A group's sums scaled by its blocks' exponents eb (one per dword, in the quads' order)
// and each token's block scales, into acc; the bias correction into corr.
template <int NT>
static inline void mxfp4_group_finish(__m512i eb, const Mxfp4Act* x, uint32_t b, __m512i (*s)[4], __m512* acc,
                                      __m512* corr) {
    // float bits (e - 1) << 23 = 2^(e - 128); e < 2 -> 0
    const __m512 dw = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_max_epi32(_mm512_sub_epi32(eb, _mm512_set1_epi32(1)), _mm512_setzero_si512()), 23));
    for (int j = 0; j < NT; ++j) {
        const __m512 coef = _mm512_mul_ps(dw, _mm512_loadu_ps(x[j].d + b));
        corr[j] = _mm512_fmadd_ps(dw, _mm512_loadu_ps(x[j].dq + b), corr[j]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mxfp4_sum_quads(s[j])), coef, acc[j]);
    }
}

// One group of m blocks (m = 16 unless TAIL) at g, block index b of the row.
template <int NT, bool TAIL>
static inline void mxfp4_group_avx512(const uint8_t* g, uint32_t m, const Mxfp4Act* x, uint32_t b, __m512* acc,
                                      __m512* corr, const __m512i lut) {
    for (int o = 0; o < 16 * (int)MXFP4_BYTES; o += 64) _mm_prefetch((const char*)g + FT_MXFP4_PREFETCH + o, _MM_HINT_T0);
    // byte 0 of dword 4i + j <- byte i of lane i (block i of quad j); the other bytes zero
    const __m512i eidx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i eb = _mm512_setzero_si512();
    if (TAIL) {
        const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0),
                                                _mm512_set1_epi32((int)MXFP4_BYTES));
        const __mmask16 mk = _mm512_cmplt_epi32_mask(gidx, _mm512_set1_epi32((int)(m * MXFP4_BYTES)));
        eb = _mm512_and_si512(_mm512_mask_i32gather_epi32(eb, mk, gidx, (const void*)g, 1), _mm512_set1_epi32(0xFF));
    }
    __m512i s[NT][4];
    for (uint32_t q = 0; q < 4; ++q) {
        const uint8_t* p = g + (size_t)(4 * q) * MXFP4_BYTES;  // the quad's first block
        __m512i z = _mm512_setzero_si512();
        if (TAIL) {
            const uint32_t nq = m > 4 * q ? (m - 4 * q < 4 ? m - 4 * q : 4) : 0;  // blocks of this quad
            if (nq > 0) z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(p + 1)));
            if (nq > 1) z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0x00F0, _mm_loadu_si128((const __m128i*)(p + 1 + MXFP4_BYTES)));
            if (nq > 2) z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0x0F00, _mm_loadu_si128((const __m128i*)(p + 1 + 2 * MXFP4_BYTES)));
            if (nq > 3) z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0xF000, _mm_loadu_si128((const __m128i*)(p + 1 + 3 * MXFP4_BYTES)));
        } else {
            eb = _mm512_mask_shuffle_epi8(eb, (__mmask64)(0x0001000100010001ull << (4 * q)), _mm512_loadu_si512(p), eidx);
            z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(p + 1)));
            z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0x00F0, _mm_loadu_si128((const __m128i*)(p + 1 + MXFP4_BYTES)));
            z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0x0F00, _mm_loadu_si128((const __m128i*)(p + 1 + 2 * MXFP4_BYTES)));
            z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0xF000, _mm_loadu_si128((const __m128i*)(p + 1 + 3 * MXFP4_BYTES)));
        }
        mxfp4_quad_dots<NT>(z, lut, x, b, q, s);
    }
    mxfp4_group_finish<NT>(eb, x, b, s, acc, corr);
}

template <int NT>
static inline void mxfp4_row_avx512(const uint8_t* row, const Mxfp4Act* x, uint32_t nb, __m512* vres) {
    __m512 acc[NT], corr[NT];
    for (int j = 0; j < NT; ++j) acc[j] = corr[j] = _mm512_setzero_ps();
    const __m512i lut = mxfp4_lut();
    const uint32_t full = nb & ~15u;
    uint32_t b = 0;
    for (; b < full; b += 16) mxfp4_group_avx512<NT, false>(row + (size_t)b * MXFP4_BYTES, 16, x, b, acc, corr, lut);
    if (b < nb) mxfp4_group_avx512<NT, true>(row + (size_t)b * MXFP4_BYTES, nb - b, x, b, acc, corr, lut);
    for (int j = 0; j < NT; ++j) vres[j] = _mm512_fmadd_ps(corr[j], _mm512_set1_ps(-128.0f), acc[j]);
}

// With AVX512-VBMI (mxfp4_vbmi(), chosen at run time): a full group's quad takes its 4 blocks'
// code bytes from two 64-byte loads (the quad's bytes 0-63 and 4-67) with one vpermt2b
// instead of four broadcast loads and three merges (0.83 -> 0.69 ns per block at T=1 on one
// core of the 2-core VM's AMD EPYC, weights in L2). The last group of a row as above.
#define FT_VBMI __attribute__((target("avx512vbmi")))
template <int NT>
FT_VBMI static inline void mxfp4_group_vbmi(const uint8_t* g, const Mxfp4Act* x, uint32_t b, __m512* acc, __m512* corr,
                                            const __m512i lut, const __m512i cidx) {
    for (int o = 0; o < 16 * (int)MXFP4_BYTES; o += 64) _mm_prefetch((const char*)g + FT_MXFP4_PREFETCH + o, _MM_HINT_T0);
    const __m512i eidx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i eb = _mm512_setzero_si512();
    __m512i s[NT][4];
    for (uint32_t q = 0; q < 4; ++q) {
        const uint8_t* p = g + (size_t)(4 * q) * MXFP4_BYTES;
        const __m512i a = _mm512_loadu_si512(p), c = _mm512_loadu_si512(p + 4);
        eb = _mm512_mask_shuffle_epi8(eb, (__mmask64)(0x0001000100010001ull << (4 * q)), a, eidx);
        mxfp4_quad_dots<NT>(_mm512_permutex2var_epi8(a, cidx, c), lut, x, b, q, s);
    }
    mxfp4_group_finish<NT>(eb, x, b, s, acc, corr);
}

template <int NT>
FT_VBMI static inline void mxfp4_row_vbmi(const uint8_t* row, const Mxfp4Act* x, uint32_t nb, __m512* vres) {
    __m512 acc[NT], corr[NT];
    for (int j = 0; j < NT; ++j) acc[j] = corr[j] = _mm512_setzero_ps();
    const __m512i lut = mxfp4_lut();
    // byte j of lane i <- the quad's byte 17 i + 1 + j: from the first load while < 64, else the second
    alignas(64) static const int8_t kIdx[64] = {
        1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,  18, 19, 20, 21, 22, 23, 24, 25,
        26, 27, 28, 29, 30, 31, 32, 33, 35, 36, 37, 38, 39, 40, 41, 42,  43, 44, 45, 46, 47, 48, 49, 50,
        52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 124, 125, 126, 127};
    const __m512i cidx = _mm512_load_si512((const void*)kIdx);
    const uint32_t full = nb & ~15u;
    uint32_t b = 0;
    for (; b < full; b += 16) mxfp4_group_vbmi<NT>(row + (size_t)b * MXFP4_BYTES, x, b, acc, corr, lut, cidx);
    if (b < nb) mxfp4_group_avx512<NT, true>(row + (size_t)b * MXFP4_BYTES, nb - b, x, b, acc, corr, lut);
    for (int j = 0; j < NT; ++j) vres[j] = _mm512_fmadd_ps(corr[j], _mm512_set1_ps(-128.0f), acc[j]);
}

// One token: rows r0..r1 in groups of 16, summed together.
static void mxfp4_rows1_avx512(const uint8_t* base, size_t stride, uint32_t r0, uint32_t r1, const Mxfp4Act* x,
                               uint32_t nb, float* out) {
    __m512 v[16];
    for (uint32_t g = r0; g < r1; g += 16) {
        const uint32_t n = r1 - g < 16 ? r1 - g : 16;
        for (uint32_t i = 0; i < n; ++i) mxfp4_row_avx512<1>(base + (size_t)(g + i) * stride, x, nb, &v[i]);
        hsum16_avx512(v, (int)n, out + (g - r0));
    }
}
FT_VBMI static void mxfp4_rows1_vbmi(const uint8_t* base, size_t stride, uint32_t r0, uint32_t r1, const Mxfp4Act* x,
                                     uint32_t nb, float* out) {
    __m512 v[16];
    for (uint32_t g = r0; g < r1; g += 16) {
        const uint32_t n = r1 - g < 16 ? r1 - g : 16;
        for (uint32_t i = 0; i < n; ++i) mxfp4_row_vbmi<1>(base + (size_t)(g + i) * stride, x, nb, &v[i]);
        hsum16_avx512(v, (int)n, out + (g - r0));
    }
}
// nt (1-4) tokens against one row.
static void mxfp4_row_nt_avx512(const uint8_t* row, const Mxfp4Act* x, uint32_t nt, uint32_t nb, __m512* v) {
    switch (nt) {
        case 4: mxfp4_row_avx512<4>(row, x, nb, v); break;
        case 3: mxfp4_row_avx512<3>(row, x, nb, v); break;
        case 2: mxfp4_row_avx512<2>(row, x, nb, v); break;
        default: mxfp4_row_avx512<1>(row, x, nb, v); break;
    }
}
FT_VBMI static void mxfp4_row_nt_vbmi(const uint8_t* row, const Mxfp4Act* x, uint32_t nt, uint32_t nb, __m512* v) {
    switch (nt) {
        case 4: mxfp4_row_vbmi<4>(row, x, nb, v); break;
        case 3: mxfp4_row_vbmi<3>(row, x, nb, v); break;
        case 2: mxfp4_row_vbmi<2>(row, x, nb, v); break;
        default: mxfp4_row_vbmi<1>(row, x, nb, v); break;
    }
}
#undef FT_VBMI
#endif

#if defined(FT_HAVE_AVX2) && !defined(FT_HAVE_AVX512)
// AVX2 tiers, one token (more take the tiles of block32_tiles_avx2.h), in groups of 8 blocks.
// A register holds two blocks' 16 code bytes (block b in the low 128-bit lane, b + 1 in the
// high one); its low and high nibbles (elements 0-15 and 16-31) become value + 12 (0..24,
// unsigned; mxfp4_lut12) with vpshufb and meet the token's codes of the same elements through
// vpmaddubsw + vpmaddwd (avx2) or two vpdpbusd (avx_vnni): 128-bit lane h of pair k's sums
// belongs to block 2 k + h. sum4_epi32 adds the four pairs' sums into one register (dword i of
// lane h: block 2 i + h), from which 12 x the blocks' code sums are taken (exact int32, the
// same on both tiers), converted once and scaled per lane by (2^(e - 128) x activation scale).
// The token's codes, scales and code sums are laid out in that order once per call
// (Mxfp4RowAct); a row's last partial group runs on a zero-padded copy of its blocks.
struct Mxfp4RowAct {
    const int8_t* qs;    // per pair of blocks b, b + 1: [b 0-15 | b + 1 0-15 | b 16-31 | b + 1 16-31]
    const float* d;      // per group of 8: blocks [0 2 4 6 1 3 5 7] of the group; 0 past the last block
    const int32_t* s12;  // 12 x code sum, the same order
};
static inline size_t mxfp4_row_act_bytes(uint32_t nb) { return (size_t)((nb + 7) / 8) * (8 * 32 + 64); }

static inline Mxfp4RowAct mxfp4_row_prepare(const ActQ8x32View& x, uint32_t nb, uint8_t* buf) {
    const uint32_t ng = (nb + 7) / 8;
    int8_t* qs = (int8_t*)buf;
    float* d = (float*)(buf + (size_t)ng * 256);
    int32_t* s12 = (int32_t*)(d + (size_t)ng * 8);
    for (uint32_t g = 0; g < ng; ++g)
        for (uint32_t i = 0; i < 8; ++i) {
            const uint32_t b = 8 * g + i;  // block i of the group: pair i / 2, lane i % 2
            int8_t* o = qs + (size_t)(8 * g + 2 * (i / 2)) * 32 + 16 * (i % 2);
            const uint32_t pos = 8 * g + (i % 2 ? 4 + i / 2 : i / 2);
            if (b < nb) {
                const int8_t* src = x.qs + (size_t)b * 32;
                std::memcpy(o, src, 16);
                std::memcpy(o + 32, src + 16, 16);
                int32_t sum = 0;
                for (int k = 0; k < 32; ++k) sum += src[k];
                d[pos] = x.d[b];
                s12[pos] = 12 * sum;
            } else {
                std::memset(o, 0, 16);
                std::memset(o + 32, 0, 16);
                d[pos] = 0.0f;
                s12[pos] = 0;
            }
        }
    return Mxfp4RowAct{qs, d, s12};
}

// Group g of a row (p: its first block; 8 blocks, the last group's copy zero-padded) into acc.
static inline __m256 mxfp4_group_avx2(const uint8_t* p, const Mxfp4RowAct& x, uint32_t g, __m256 acc) {
    const __m256i lut = mxfp4_lut12(), m4 = _mm256_set1_epi8(0x0F);
    __m256i R[4];
    for (int k = 0; k < 4; ++k) {
        const uint8_t* q = p + (size_t)(2 * k) * MXFP4_BYTES;
        const __m256i z = _mm256_loadu2_m128i((const __m128i*)(q + MXFP4_BYTES + 1), (const __m128i*)(q + 1));
        const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(z, m4));
        const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(z, 4), m4));
        const int8_t* xs = x.qs + (size_t)(8 * g + 2 * k) * 32;
        const __m256i xl = _mm256_loadu_si256((const __m256i*)xs), xh = _mm256_loadu_si256((const __m256i*)(xs + 32));
#if defined(FT_HAVE_AVX_VNNI)
        R[k] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wl, xl), wh, xh);
#else
        // int16 pairs of the two halves: at most 2 x 2 x 24 x 127
        R[k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wl, xl), _mm256_maddubs_epi16(wh, xh)),
                                 _mm256_set1_epi16(1));
#endif
    }
    const __m256i J = _mm256_sub_epi32(sum4_epi32(R[0], R[1], R[2], R[3]), _mm256_loadu_si256((const __m256i*)(x.s12 + 8 * g)));
    const __m256i e = _mm256_setr_epi32(p[0], p[2 * MXFP4_BYTES], p[4 * MXFP4_BYTES], p[6 * MXFP4_BYTES], p[MXFP4_BYTES],
                                        p[3 * MXFP4_BYTES], p[5 * MXFP4_BYTES], p[7 * MXFP4_BYTES]);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(J), _mm256_mul_ps(mxfp4_scales8(e), _mm256_loadu_ps(x.d + 8 * g)), acc);
}

static inline __m256 mxfp4_row_avx2(const uint8_t* row, uint32_t nb, const Mxfp4RowAct& x) {
    __m256 acc = _mm256_setzero_ps();
    const uint32_t full = nb / 8;
    for (uint32_t g = 0; g < full; ++g) {
        const uint8_t* p = row + (size_t)g * 8 * MXFP4_BYTES;
        for (int o = 0; o < 8 * (int)MXFP4_BYTES; o += 64) _mm_prefetch((const char*)p + 2048 + o, _MM_HINT_T0);
        acc = mxfp4_group_avx2(p, x, g, acc);
    }
    if (nb > 8 * full) {
        uint8_t tail[8 * MXFP4_BYTES] = {};
        std::memcpy(tail, row + (size_t)full * 8 * MXFP4_BYTES, (size_t)(nb - 8 * full) * MXFP4_BYTES);
        acc = mxfp4_group_avx2(tail, x, full, acc);
    }
    return acc;
}
#endif

static void dot_rows_mxfp4(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                           const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_MXFP4;
#if defined(FT_HAVE_AVX512)
    // the tokens' codes and scales in the kernel's order, once per call (per token: ~3 KB
    // for GPT-OSS's 2912 columns, a few hundred ns against the call's rows)
    thread_local std::vector<uint8_t> scratch;
    const size_t per_tok = (mxfp4_act_bytes(nb) + 63) & ~(size_t)63;
    if (scratch.size() < 4 * per_tok + 64) scratch.resize(4 * per_tok + 64);
    uint8_t* sp = (uint8_t*)(((uintptr_t)scratch.data() + 63) & ~(uintptr_t)63);
    Mxfp4Act xv[4];
    const bool vbmi = mxfp4_vbmi();
    if (ntok == 1) {
        xv[0] = mxfp4_prepare_act(q8x32_view(xs[0], w.cols), nb, sp);
        (vbmi ? mxfp4_rows1_vbmi : mxfp4_rows1_avx512)(base, w.row_stride, r0, r1, xv, nb, out);
        return;
    }
#elif defined(FT_HAVE_AVX2)
    if (ntok >= 2) {
        dot_rows_b32_tiles<FT_FMT_MXFP4>(w, e, r0, r1, xs, ntok, out, os);
        return;
    }
    thread_local std::vector<uint8_t> scratch;
    if (scratch.size() < mxfp4_row_act_bytes(nb)) scratch.resize(mxfp4_row_act_bytes(nb));
    const Mxfp4RowAct xa = mxfp4_row_prepare(q8x32_view(xs[0], w.cols), nb, scratch.data());
    for (uint32_t g = r0; g < r1; g += 8) {  // rows in groups of 8, summed together
        const uint32_t n = std::min(8u, r1 - g);
        __m256 v[8];
        for (uint32_t i = 0; i < 8; ++i)
            v[i] = i < n ? mxfp4_row_avx2(base + (size_t)(g + i) * w.row_stride, nb, xa) : _mm256_setzero_ps();
        const __m256 sums = hsum8_ps(v);
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sums);
        for (uint32_t i = 0; i < n; ++i) out[g - r0 + i] = tmp[i];
    }
#else
    ActQ8x32View xv[4];
#endif
#if !defined(FT_HAVE_AVX2) || defined(FT_HAVE_AVX512)
    for (uint32_t j0 = 0; j0 < ntok; j0 += 4) {
        const uint32_t nt = ntok - j0 < 4 ? ntok - j0 : 4;
#if defined(FT_HAVE_AVX512)
        for (uint32_t j = 0; j < nt; ++j) xv[j] = mxfp4_prepare_act(q8x32_view(xs[j0 + j], w.cols), nb, sp + j * per_tok);
#else
        for (uint32_t j = 0; j < nt; ++j) xv[j] = q8x32_view(xs[j0 + j], w.cols);
#endif
        for (uint32_t r = r0; r < r1; ++r) {
            const uint8_t* row = base + (size_t)r * w.row_stride;
            float res[4];
#if defined(FT_HAVE_AVX512)
            __m512 v[4];
            (vbmi ? mxfp4_row_nt_vbmi : mxfp4_row_nt_avx512)(row, xv, nt, nb, v);
            for (uint32_t j = 0; j < nt; ++j) res[j] = _mm512_reduce_add_ps(v[j]);
#else
            for (uint32_t j = 0; j < nt; ++j) res[j] = mxfp4_row_portable(row, xv[j], nb);
#endif
            for (uint32_t j = 0; j < nt; ++j) out[(j0 + j) * os + (r - r0)] = res[j];
        }
    }
#endif
}
