// Float weight formats (F32, F16, BF16, FP8 E4M3 with 128x128 block scales) on the AVX2
// tiers (avx2, avx_vnni), against float32 activations. Included by fmt_float.h.
//
// Weights are converted 16 at a time into two float vectors (Avx*::load16; FP8 32 at a time
// into four) and multiplied into register tiles of NR rows x NT tokens: each converted vector
// serves NT tokens, each activation load NR rows. One or two tokens: one row at a time, four
// or two accumulators (FMA latency), the weight stream prefetched in software 2 KB ahead,
// across row ends (a core that converts between its loads keeps too few lines in flight with
// the hardware prefetchers alone). More tokens: 2 rows x 4 tokens (F32/F16/BF16), FMA-bound;
// FP8 1 row x 4 tokens (its per-block scales need a second set of accumulators), or x 8 tokens
// with the block scale applied to the converted weights.
// Columns past the last whole 16 (FP8: 32 per 128-column block) are added by the portable
// loaders.
#pragma once

struct AvxF32 {
    static constexpr int ESZ = 4;
    static inline void load16(const uint8_t* p, __m256& lo, __m256& hi) {
        lo = _mm256_loadu_ps((const float*)p);
        hi = _mm256_loadu_ps((const float*)p + 8);
    }
};
struct AvxF16 {
    static constexpr int ESZ = 2;
    static inline void load16(const uint8_t* p, __m256& lo, __m256& hi) {
        lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
    }
};
struct AvxBF16 {  // bf16 = the high half of a float32
    static constexpr int ESZ = 2;
    static inline void load16(const uint8_t* p, __m256& lo, __m256& hi) {
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
        hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16))), 16));
    }
};
// FP8 E4M3, 32 weights at a time, converted to f16 bits of value / 2^8 in 16-bit lanes
// without crossing 128-bit lanes: the even bytes shifted to the high byte and the odd bytes
// as they are, then an arithmetic shift right by 1 puts the sign in bit 15 (and a copy in
// bit 14, cleared) and exponent/mantissa in bits 13..7; the bits below (the other byte) are
// cleared too. Subnormal E4M3 codes become subnormal f16, exactly; the 2^8 goes into the
// block scale. NaN codes do not occur in checkpoints. The four vectors hold the elements in
// the order [0 2 .. 14 | 16 18 .. 30 | 1 3 .. 15 | 17 19 .. 31]; the activations are
// copied in that order once per call (fp8_permute_x).
static inline void fp8_load32(const uint8_t* p, __m256* w) {
    const __m256i m = _mm256_set1_epi16((short)0xBF80);
    const __m256i v = _mm256_loadu_si256((const __m256i*)p);
    const __m256i ev = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), m);
    const __m256i od = _mm256_and_si256(_mm256_srai_epi16(v, 1), m);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(ev));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(ev, 1));
    w[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(od));
    w[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(od, 1));
}
// dst = x's whole 32s in fp8_load32's order (the columns past them are read from x itself)
static inline void fp8_permute_x(const float* x, uint32_t n, float* dst) {
    for (uint32_t c = 0; c + 32 <= n; c += 32)
        for (int h = 0; h < 2; ++h) {
            const __m256 a = _mm256_loadu_ps(x + c + 16 * h), b = _mm256_loadu_ps(x + c + 16 * h + 8);
            // [a0 a2 b0 b2 | a4 a6 b4 b6] -> qwords 0, 2, 1, 3 -> even elements of the 16 in order
            const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
            _mm256_storeu_ps(dst + c + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
            _mm256_storeu_ps(dst + c + 16 + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
        }
}
struct LoadFP8Div256 { static float at(const uint8_t* p, uint32_t i) { return fp8_e4m3_to_float(p[i]) * 0x1p-8f; } };

#ifndef FT_FLOAT_PREFETCH
#define FT_FLOAT_PREFETCH 2048
#endif

// acc[r][t][k] += the products of columns [c0, c0 + n16) of rows[r] and x[t] (n16 a multiple
// of 16), spread over K accumulators per row and token.
template <class L, int NR, int NT, int K>
static inline void float_tile_avx2(const uint8_t* const* rows, const float* const* x, uint32_t c0, uint32_t n16,
                                   __m256 (*acc)[NT][K]) {
    // columns per iteration: few tokens (memory-bound) 64 bytes of each row, one prefetch each;
    // many tokens one pair of vectors per pair of accumulators
    constexpr uint32_t STEP = NT <= 2 ? 64 / L::ESZ : 16 * (K > 2 ? K / 2 : 1);
    uint32_t c = 0;
    for (; c + STEP <= n16; c += STEP) {
        if (NT <= 2)
            for (int r = 0; r < NR; ++r)
                _mm_prefetch((const char*)rows[r] + (size_t)(c0 + c) * L::ESZ + FT_FLOAT_PREFETCH, _MM_HINT_T0);
        for (uint32_t u = 0; u < STEP / 16; ++u) {
            const uint32_t cc = c0 + c + 16 * u;
            const int k0 = (2 * u) % K, k1 = (2 * u + 1) % K;
            // all rows' weights first, then each token's activations once for all rows
            // (2 NR + NR NT K + 2 registers)
            __m256 lo[NR], hi[NR];
            for (int r = 0; r < NR; ++r) L::load16(rows[r] + (size_t)cc * L::ESZ, lo[r], hi[r]);
            for (int t = 0; t < NT; ++t) {
                const __m256 xl = _mm256_loadu_ps(x[t] + cc), xh = _mm256_loadu_ps(x[t] + cc + 8);
                for (int r = 0; r < NR; ++r) {
                    acc[r][t][k0] = _mm256_fmadd_ps(lo[r], xl, acc[r][t][k0]);
                    acc[r][t][k1] = _mm256_fmadd_ps(hi[r], xh, acc[r][t][k1]);
                }
            }
        }
    }
    for (; c < n16; c += 16) {
        const uint32_t cc = c0 + c;
        __m256 lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) L::load16(rows[r] + (size_t)cc * L::ESZ, lo[r], hi[r]);
        for (int t = 0; t < NT; ++t) {
            const __m256 xl = _mm256_loadu_ps(x[t] + cc), xh = _mm256_loadu_ps(x[t] + cc + 8);
            for (int r = 0; r < NR; ++r) {
                acc[r][t][0] = _mm256_fmadd_ps(lo[r], xl, acc[r][t][0]);
                acc[r][t][K - 1] = _mm256_fmadd_ps(hi[r], xh, acc[r][t][K - 1]);
            }
        }
    }
}

// Rows [r, r + NR) x tokens [j, j + NT) of a float format without block scales.
template <class L, class P, int NR, int NT>
static inline void float_rows_avx2(const uint8_t* base, size_t row_stride, uint32_t cols, uint32_t r, uint32_t r0,
                                   const float* const* x, float* out, size_t os) {
    constexpr int K = NR * NT >= 4 ? 1 : (NR * NT == 2 ? 2 : 4);
    const uint8_t* rows[NR];
    for (int i = 0; i < NR; ++i) rows[i] = base + (size_t)(r + i) * row_stride;
    __m256 acc[NR][NT][K];
    for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t)
            for (int k = 0; k < K; ++k) acc[i][t][k] = _mm256_setzero_ps();
    const uint32_t n16 = cols & ~15u;
    float_tile_avx2<L, NR, NT, K>(rows, x, 0, n16, acc);
    for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) {
            for (int k = 1; k < K; ++k) acc[i][t][0] = _mm256_add_ps(acc[i][t][0], acc[i][t][k]);
            float s = hsum256(acc[i][t][0]);
            for (uint32_t c = n16; c < cols; ++c) s += P::at(rows[i], c) * x[t][c];
            out[(size_t)t * os + (r + i - r0)] = s;
        }
}

// Few tokens: one row at a time, so the weights are one stream that the prefetches (a fixed
// distance ahead, across row ends) follow; many tokens: rows in pairs.
template <class L, class P, int NT>
static inline void float_rows_nt_avx2(const uint8_t* base, size_t row_stride, uint32_t cols, uint32_t r0, uint32_t r1,
                                      const float* const* x, float* out, size_t os) {
    constexpr int NR = NT <= 2 ? 1 : 2;
    uint32_t r = r0;
    for (; r + NR <= r1; r += NR) float_rows_avx2<L, P, NR, NT>(base, row_stride, cols, r, r0, x, out, os);
    for (; r < r1; ++r) float_rows_avx2<L, P, 1, NT>(base, row_stride, cols, r, r0, x, out, os);
}

template <class L, class P>
static void dot_rows_float_avx2(const uint8_t* base, size_t row_stride, uint32_t cols, uint32_t r0, uint32_t r1,
                                const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const float* const* x = (const float* const*)xs;
    for (uint32_t j = 0; j < ntok; j += 4) {
        switch (std::min(4u, ntok - j)) {
            case 4: float_rows_nt_avx2<L, P, 4>(base, row_stride, cols, r0, r1, x + j, out + (size_t)j * os, os); break;
            case 3: float_rows_nt_avx2<L, P, 3>(base, row_stride, cols, r0, r1, x + j, out + (size_t)j * os, os); break;
            case 2: float_rows_nt_avx2<L, P, 2>(base, row_stride, cols, r0, r1, x + j, out + (size_t)j * os, os); break;
            default: float_rows_nt_avx2<L, P, 1>(base, row_stride, cols, r0, r1, x + j, out + (size_t)j * os, os); break;
        }
    }
}

// acc[r][t][k] += the products of columns [c0, c0 + n32) of FP8 rows[r] and the permuted
// activations xp[t] (n32 a multiple of 32).
template <int NR, int NT, int K>
static inline void fp8_tile_avx2(const uint8_t* const* rows, const float* const* xp, uint32_t c0, uint32_t n32,
                                 __m256 (*acc)[NT][K]) {
    for (uint32_t c = 0; c < n32; c += 32) {
        const uint32_t cc = c0 + c;
        if (NT <= 2 && (cc & 63) == 0)
            for (int r = 0; r < NR; ++r) _mm_prefetch((const char*)rows[r] + cc + FT_FLOAT_PREFETCH, _MM_HINT_T0);
        __m256 w[NR][4];
        for (int r = 0; r < NR; ++r) fp8_load32(rows[r] + cc, w[r]);
        for (int t = 0; t < NT; ++t)
            for (int q = 0; q < 4; ++q) {
                const __m256 xv = _mm256_loadu_ps(xp[t] + cc + 8 * q);
                for (int r = 0; r < NR; ++r) acc[r][t][q % K] = _mm256_fmadd_ps(w[r][q], xv, acc[r][t][q % K]);
            }
    }
}

// FP8 rows [r, r + NR) x tokens [j, j + NT) (xp: the permuted activations, x: as they are):
// per 128-column block, the block's products in acc, then scaled by the block's scale (x 2^8)
// into tot.
template <int NR, int NT>
static inline void fp8_rows_avx2(const uint8_t* base, size_t row_stride, const float* sbase, uint32_t ncb, uint32_t cols,
                                 uint32_t r, uint32_t r0, const float* const* x, const float* const* xp, float* out,
                                 size_t os) {
    constexpr int K = NR * NT >= 4 ? 1 : (NR * NT == 2 ? 2 : 4);
    const uint8_t* rows[NR];
    const float* srow[NR];
    for (int i = 0; i < NR; ++i) {
        rows[i] = base + (size_t)(r + i) * row_stride;
        srow[i] = sbase + (size_t)((r + i) / FP8_BLOCK) * ncb;
    }
    __m256 tot[NR][NT];
    float tail[NR][NT];
    for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) {
            tot[i][t] = _mm256_setzero_ps();
            tail[i][t] = 0.0f;
        }
    for (uint32_t cb = 0, c0 = 0; c0 < cols; ++cb, c0 += FP8_BLOCK) {
        const uint32_t n = std::min(FP8_BLOCK, cols - c0), n32 = n & ~31u;
        __m256 acc[NR][NT][K];
        for (int i = 0; i < NR; ++i)
            for (int t = 0; t < NT; ++t)
                for (int k = 0; k < K; ++k) acc[i][t][k] = _mm256_setzero_ps();
        fp8_tile_avx2<NR, NT, K>(rows, xp, c0, n32, acc);
        for (int i = 0; i < NR; ++i) {
            const float s = srow[i][cb] * 256.0f;
            const __m256 sv = _mm256_set1_ps(s);
            for (int t = 0; t < NT; ++t) {
                for (int k = 1; k < K; ++k) acc[i][t][0] = _mm256_add_ps(acc[i][t][0], acc[i][t][k]);
                tot[i][t] = _mm256_fmadd_ps(acc[i][t][0], sv, tot[i][t]);
                if (n32 < n) {
                    float p = 0.0f;
                    for (uint32_t c = c0 + n32; c < c0 + n; ++c) p += LoadFP8Div256::at(rows[i], c) * x[t][c];
                    tail[i][t] += p * s;
                }
            }
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) out[(size_t)t * os + (r + i - r0)] = hsum256(tot[i][t]) + tail[i][t];
}

// Eight tokens: one row, the block scale (x 2^8) folded into the converted weights (one
// multiply per 8 weights, shared by the 8 tokens), so the 8 accumulators run over the whole
// row and no second set is needed: the conversion, which shares the FMA pipes, is spread
// over twice as many FMAs as with 4 tokens.
static inline void fp8_row8_avx2(const uint8_t* row, const float* srow, uint32_t cols, const float* const* x,
                                 const float* const* xp, float* out, size_t os) {
    __m256 acc[8];
    float tail[8];
    for (int t = 0; t < 8; ++t) {
        acc[t] = _mm256_setzero_ps();
        tail[t] = 0.0f;
    }
    for (uint32_t cb = 0, c0 = 0; c0 < cols; ++cb, c0 += FP8_BLOCK) {
        const uint32_t n = std::min(FP8_BLOCK, cols - c0), n32 = n & ~31u;
        const float s = srow[cb] * 256.0f;
        const __m256 sv = _mm256_set1_ps(s);
        for (uint32_t c = c0; c < c0 + n32; c += 32) {
            __m256 w[4];
            fp8_load32(row + c, w);
            for (int q = 0; q < 4; ++q) w[q] = _mm256_mul_ps(w[q], sv);
            for (int t = 0; t < 8; ++t)
                for (int q = 0; q < 4; ++q) acc[t] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xp[t] + c + 8 * q), acc[t]);
        }
        if (n32 < n)
            for (int t = 0; t < 8; ++t) {
                float p = 0.0f;
                for (uint32_t c = c0 + n32; c < c0 + n; ++c) p += LoadFP8Div256::at(row, c) * x[t][c];
                tail[t] += p * s;
            }
    }
    for (int t = 0; t < 8; ++t) out[(size_t)t * os] = hsum256(acc[t]) + tail[t];
}

template <int NR, int NT>
static inline void fp8_rows_nt_avx2(const uint8_t* base, size_t row_stride, const float* sbase, uint32_t ncb, uint32_t cols,
                                    uint32_t r0, uint32_t r1, const float* const* x, const float* const* xp, float* out,
                                    size_t os) {
    uint32_t r = r0;
    for (; r + NR <= r1; r += NR) fp8_rows_avx2<NR, NT>(base, row_stride, sbase, ncb, cols, r, r0, x, xp, out, os);
    for (; r < r1; ++r) fp8_rows_avx2<1, NT>(base, row_stride, sbase, ncb, cols, r, r0, x, xp, out, os);
}

static void dot_rows_fp8_avx2(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1, const void* const* xs,
                              uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const float* sbase = (const float*)((const uint8_t*)(uintptr_t)w.scale + (size_t)e * w.scale_expert_stride);
    const uint32_t ncb = (w.cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const float* const* x = (const float* const*)xs;
    thread_local std::vector<float> scratch;
    const size_t per = ((size_t)w.cols + 15) & ~(size_t)15;
    if (scratch.size() < 8 * per) scratch.resize(8 * per);
    uint32_t j = 0;
    for (; j + 8 <= ntok; j += 8) {
        const float* xp[8];
        for (uint32_t t = 0; t < 8; ++t) {
            fp8_permute_x(x[j + t], w.cols, scratch.data() + t * per);
            xp[t] = scratch.data() + t * per;
        }
        for (uint32_t r = r0; r < r1; ++r)
            fp8_row8_avx2(base + (size_t)r * w.row_stride, sbase + (size_t)(r / FP8_BLOCK) * ncb, w.cols, x + j, xp,
                          out + (size_t)j * os + (r - r0), os);
    }
    for (; j < ntok; j += 4) {
        const uint32_t nt = std::min(4u, ntok - j);
        const float* xp[4];
        for (uint32_t t = 0; t < nt; ++t) {
            fp8_permute_x(x[j + t], w.cols, scratch.data() + t * per);
            xp[t] = scratch.data() + t * per;
        }
        float* o = out + (size_t)j * os;
        switch (nt) {
            case 4: fp8_rows_nt_avx2<1, 4>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, xp, o, os); break;
            case 3: fp8_rows_nt_avx2<1, 3>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, xp, o, os); break;
            case 2: fp8_rows_nt_avx2<1, 2>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, xp, o, os); break;
            default: fp8_rows_nt_avx2<1, 1>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, xp, o, os); break;
        }
    }
}
