// Float weight formats (F32, F16, BF16, FP8 E4M3 with 128x128 block scales) on the AVX2
// tiers (avx2, avx_vnni), against float32 activations. Included by kernels_isa.inc after
// fmt_float.h (whose portable loaders add the columns past the vectors).
//
// Weights are converted 16 at a time into two float vectors (Avx*::load16; FP8 32 at a time
// into four) and multiplied into register tiles of NR rows x NT tokens: each converted vector
// serves NT tokens, each activation load NR rows. One or two tokens: one row at a time, four
// or two accumulators (FMA latency), the weight stream prefetched in software 2 KB ahead,
// across row ends (a core that converts between its loads keeps too few lines in flight with
// the hardware prefetchers alone). More tokens: 2 rows x 4 tokens (F32/F16/BF16), FMA-bound.
// FP8: 1 row x up to 4 or 8 tokens, its block scales folded into the activations (see the
// FP8 section). Columns past the last whole 16 (FP8: 32) are added by the portable loaders.
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
// FP8 E4M3 with 128x128 block scales. Each conversion turns 32 bytes into four float
// vectors without crossing 128-bit lanes, in an order of its own; the activations are
// copied in that order, each whole 32 times its 128-column block's scale of the current
// 128-row block and the conversion's factor kAct (prepare, once per row block and token),
// so that a row is one plain dot product: no per-block sums or scales in the inner loop.
// The products are then the real ones times kOut^-1. The NaN codes (0x7f, 0xff) do not
// occur in checkpoints and are not special-cased: they read as +-480, what their bits would
// mean as a normal number.
//
// Fp8F16: f16 bits of value / 2^8 in 16-bit lanes, then vcvtph2ps: the even bytes shifted
// to the high byte and the odd bytes as they are, an arithmetic shift right by 1 puts the
// sign in bit 15 (and a copy in bit 14, cleared) and exponent/mantissa in bits 13..7; the
// bits below (the other byte) are cleared too. Subnormal E4M3 codes become subnormal f16
// (normal float32), exactly. Order [0 2 .. 14 | 16 18 .. 30 | 1 3 .. 15 | 17 19 .. 31].
// vcvtph2ps runs on the FMA pipes (2 of them here, AMD Zen 4): one core converts and
// multiplies ~15 GB/s of E4M3 at one token, short of its share of the memory bandwidth.
struct Fp8F16 {
    static constexpr float kAct = 0x1p8f, kOut = 1.0f;
    static inline void load32(const uint8_t* p, __m256* w) {
        const __m256i m = _mm256_set1_epi16((short)0xBF80);
        const __m256i v = _mm256_loadu_si256((const __m256i*)p);
        const __m256i ev = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), m);
        const __m256i od = _mm256_and_si256(_mm256_srai_epi16(v, 1), m);
        w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(ev));
        w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(ev, 1));
        w[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(od));
        w[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(od, 1));
    }
    // dst[0, n32) = x's whole 32s in load32's order, each times srow[its block] * kAct
    static inline void prepare(const float* x, uint32_t n32, const float* srow, float* dst) {
        for (uint32_t c = 0; c < n32; c += 32) {
            const __m256 k = _mm256_set1_ps(srow[c / FP8_BLOCK] * kAct);
            for (int h = 0; h < 2; ++h) {
                const __m256 a = _mm256_loadu_ps(x + c + 16 * h), b = _mm256_loadu_ps(x + c + 16 * h + 8);
                // [a0 a2 b0 b2 | a4 a6 b4 b6] -> qwords 0, 2, 1, 3 -> even elements of the 16 in order
                const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
                _mm256_storeu_ps(dst + c + 8 * h, _mm256_mul_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)), k));
                _mm256_storeu_ps(dst + c + 16 + 8 * h, _mm256_mul_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)), k));
            }
        }
    }
};

// Fp8Bits: float32 bits by integer moves alone (shifts and ands, off the FMA pipes): the
// code s.eeee.mmm as s << 31 | eeee.mmm << 20, i.e. the 4-bit exponent in the low bits of
// the float32 exponent field, not rebiased, and the 3-bit mantissa at the top of the
// float32 mantissa. That is the value times 2^-120 (float32 bias 127 against E4M3's 7),
// exactly, for normal codes (exponent field 1..15 -> float32 exponents 1..15, normal) and
// subnormal ones (exponent field 0, (m/8) 2^-6 -> (m/8) 2^-126, a float32 subnormal) alike;
// +-0 stays +-0. The 16-bit lanes hold bytes 4j, 4j+1 (low half of dword j) and 4j+2, 4j+3
// (high half): the even byte moved to the high byte of its lane (the odd one is there), an
// arithmetic shift right by 4 puts the sign in bits 15..11 and exponent/mantissa in 10..4
// (3..0: bits of the other byte); high halves are then in place, low halves go up by a
// 32-bit shift by 16, and the mask 0x87F00000 keeps the sign and the seven bits. Order:
// vector q holds bytes 4j + q, j = 0..7 (prepare: a 8x4 -> 4x8 transpose).
//
// The 2^120 goes into the activations (kAct = 2^64, with the block scale) and the output
// (kOut = 2^56), so the inner loop has no extra multiply; the products are v s x 2^-56
// (v the E4M3 value, s the block scale). Ranges: |x s| below 2^64 (1.8e19). The kernels
// that use it run with DAZ off (DenormalInputsScope: else the subnormal weights read as
// zero) and FTZ on, so a running sum of a row's products is flushed to zero only while
// below 2^-126, i.e. below 2^-70 (8.5e-22) in real units (2^-126 with Fp8F16).
// Activations that are subnormal float32 are read as they are (x s 2^64 is normal unless
// s is tiny).
struct Fp8Bits {
    static constexpr float kAct = 0x1p64f, kOut = 0x1p56f;
    static inline void load32(const uint8_t* p, __m256* w) {
        const __m256i m = _mm256_set1_epi32((int)0x87F00000u);
        const __m256i v = _mm256_loadu_si256((const __m256i*)p);
        const __m256i e = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4);  // bytes 4j (low half), 4j+2 (high)
        const __m256i o = _mm256_srai_epi16(v, 4);                        // bytes 4j+1, 4j+3
        w[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(e, 16), m));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(o, 16), m));
        w[2] = _mm256_castsi256_ps(_mm256_and_si256(e, m));
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(o, m));
    }
    // dst[8q + j] = x[4j + q] * srow[its block] * kAct for each whole 32 of [0, n32)
    static inline void prepare(const float* x, uint32_t n32, const float* srow, float* dst) {
        for (uint32_t c = 0; c < n32; c += 32) {
            const __m256 k = _mm256_set1_ps(srow[c / FP8_BLOCK] * kAct);
            const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
            const __m256 e = _mm256_loadu_ps(x + c + 16), d = _mm256_loadu_ps(x + c + 24);
            // rows of 4: A = [0 | 4], B = [1 | 5], C = [2 | 6], D = [3 | 7] (128-bit lanes)
            const __m256 A = _mm256_permute2f128_ps(a, e, 0x20), B = _mm256_permute2f128_ps(a, e, 0x31);
            const __m256 C = _mm256_permute2f128_ps(b, d, 0x20), D = _mm256_permute2f128_ps(b, d, 0x31);
            const __m256 t0 = _mm256_unpacklo_ps(A, B), t1 = _mm256_unpacklo_ps(C, D);
            const __m256 t2 = _mm256_unpackhi_ps(A, B), t3 = _mm256_unpackhi_ps(C, D);
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_shuffle_ps(t0, t1, 0x44), k));
            _mm256_storeu_ps(dst + c + 8, _mm256_mul_ps(_mm256_shuffle_ps(t0, t1, 0xEE), k));
            _mm256_storeu_ps(dst + c + 16, _mm256_mul_ps(_mm256_shuffle_ps(t2, t3, 0x44), k));
            _mm256_storeu_ps(dst + c + 24, _mm256_mul_ps(_mm256_shuffle_ps(t2, t3, 0xEE), k));
        }
    }
};

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

// acc[t][k] += the products of the 32 columns from c of an FP8 row and the prepared
// activations xp[t]; S alternates accumulator sets between consecutive 32s.
template <class CV, int NT, int K, int S>
static inline __attribute__((always_inline)) void fp8_step32(const uint8_t* row, const float* const* xp, uint32_t c,
                                                             __m256 (&acc)[NT][K]) {
    __m256 w[4];
    CV::load32(row + c, w);
    for (int t = 0; t < NT; ++t)
        for (int q = 0; q < 4; ++q) {
            constexpr int k0 = 4 * S;
            acc[t][(k0 + q) % K] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xp[t] + c + 8 * q), acc[t][(k0 + q) % K]);
        }
}

// One FP8 row's whole 32s [0, n32) x NT tokens of prepared activations: the dot products,
// unreduced, in res (times CV::kOut^-1), over the whole row (the scales are in the
// activations). K accumulators per token cover the FMA latency (4 cycles): 8 at one token,
// 4 at two (one FMA each per 32 columns), 2 at three and four (FMA-bound, as at eight with
// one). One or two tokens: the weight stream prefetched in software into L2 (prefetcht1)
// FT_FP8_PREFETCH bytes ahead, across row ends (a core that converts between its loads keeps
// too few lines in flight with the hardware prefetchers alone). On a 2-core Zen 4 VM at T=1,
// against a 37 GB/s ceiling: into L1 2 KB ahead 29-32 GB/s, 4 KB 32-33, 8 KB 30-32; into L2
// 8-16 KB ahead 35-36 (and 44-46 where the ceiling rose to ~66).
#ifndef FT_FP8_PREFETCH
#define FT_FP8_PREFETCH 8192
#endif
template <class CV, int NT>
static inline void fp8_row_avx2(const uint8_t* row, uint32_t n32, const float* const* xp, __m256 (&res)[NT]) {
    constexpr int K = NT == 1 ? 8 : NT == 2 ? 4 : NT <= 4 ? 2 : 1;
    __m256 acc[NT][K];
    for (int t = 0; t < NT; ++t)
        for (int k = 0; k < K; ++k) acc[t][k] = _mm256_setzero_ps();
    uint32_t c = 0;
    for (; c + 64 <= n32; c += 64) {
        if (NT <= 2) _mm_prefetch((const char*)row + c + FT_FP8_PREFETCH, _MM_HINT_T1);
        fp8_step32<CV, NT, K, 0>(row, xp, c, acc);
        fp8_step32<CV, NT, K, 1>(row, xp, c + 32, acc);
    }
    if (c < n32) fp8_step32<CV, NT, K, 0>(row, xp, c, acc);
    // in loops of constant trip counts, unrolled early, so that acc stays in registers (a
    // loop that halved its bound kept it in memory, reloaded in the FMA chains)
    for (int t = 0; t < NT; ++t) {
        if (K == 8)
            for (int k = 0; k < 4; ++k) acc[t][k] = _mm256_add_ps(acc[t][k], acc[t][(k + 4) % K]);
        if (K >= 4)
            for (int k = 0; k < 2; ++k) acc[t][k] = _mm256_add_ps(acc[t][k], acc[t][(k + 2) % K]);
        if (K >= 2) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][1 % K]);
        res[t] = acc[t][0];
    }
}

// Rows [r0, r1) x tokens [0, NT), per 128-row block and, from three tokens on (FMA-bound,
// where every row reads each prepared activation), in passes over columns whose prepared
// activations take at most 16 KB, half an L1 (whole rows of 2048 columns at four tokens
// filled it): the pass's activations prepared with the block's scales, one token after the
// other in one contiguous piece (token arrays a multiple of 4 KB apart fell into the same
// L1 sets), then row by row, each pass adding its part of the dot products to out. The
// columns past the whole 32s (all in the last column block) in real units: exact E4M3
// values, the activations as they are, that block's scale. scratch: NT x cols floats.
template <class CV, int NT>
static void fp8_rows_avx2(const uint8_t* base, size_t row_stride, const float* sbase, uint32_t ncb, uint32_t cols,
                          uint32_t r0, uint32_t r1, const float* const* x, float* scratch, float* out, size_t os) {
    constexpr uint32_t CHUNK = NT <= 2 ? 0xFFFFFFFFu : (16384u / 4 / NT) & ~(FP8_BLOCK - 1);
    const uint32_t n32 = cols & ~31u;
    for (uint32_t r = r0; r < r1;) {
        const uint32_t rb = r / FP8_BLOCK, rend = std::min(r1, (rb + 1) * FP8_BLOCK);
        const float* srow = sbase + (size_t)rb * ncb;
        for (uint32_t c0 = 0; c0 < n32 || c0 == 0; c0 += CHUNK) {
            const uint32_t n = std::min(CHUNK, n32 - c0);
            const float* xp[NT];
            for (int t = 0; t < NT; ++t) {
                CV::prepare(x[t] + c0, n, srow + c0 / FP8_BLOCK, scratch + (size_t)t * n);
                xp[t] = scratch + (size_t)t * n;
            }
            for (uint32_t i = r; i < rend; ++i) {
                __m256 res[NT];
                fp8_row_avx2<CV, NT>(base + (size_t)i * row_stride + c0, n, xp, res);
                for (int t = 0; t < NT; ++t) {
                    float& o = out[(size_t)t * os + (i - r0)];
                    const float v = hsum256(res[t]) * CV::kOut;
                    o = c0 == 0 ? v : o + v;
                }
            }
            if (n32 - c0 <= CHUNK) break;
        }
        if (n32 < cols)
            for (uint32_t i = r; i < rend; ++i) {
                const uint8_t* row = base + (size_t)i * row_stride;
                for (int t = 0; t < NT; ++t) {
                    float tail = 0.0f;
                    for (uint32_t c = n32; c < cols; ++c) tail += fp8_e4m3_to_float(row[c]) * x[t][c];
                    out[(size_t)t * os + (i - r0)] += tail * srow[ncb - 1];
                }
            }
        r = rend;
    }
}

// Tokens in eights with Fp8F16 (FMA-bound: vcvtph2ps is spread over 32 FMAs per 32
// weights, and on par with Fp8Bits there, measured; its weights are never subnormal, which
// spares Intel cores the assists), the rest in fours and fewer with Fp8Bits (one to four
// tokens are the memory-bound calls), under DenormalInputsScope.
static void dot_rows_fp8_avx2(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1, const void* const* xs,
                              uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const float* sbase = (const float*)((const uint8_t*)(uintptr_t)w.scale + (size_t)e * w.scale_expert_stride);
    const uint32_t ncb = (w.cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const float* const* x = (const float* const*)xs;
    thread_local std::vector<float> scratch;
    if (scratch.size() < 8 * (size_t)w.cols) scratch.resize(8 * (size_t)w.cols);
    float* sc = scratch.data();
    uint32_t j = 0;
    for (; j + 8 <= ntok; j += 8)
        fp8_rows_avx2<Fp8F16, 8>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, sc, out + (size_t)j * os, os);
    if (j == ntok) return;
    DenormalInputsScope subnormal_weights;  // Fp8Bits' weights are 2^-120 times their values
    for (; j < ntok; j += 4) {
        float* o = out + (size_t)j * os;
        switch (std::min(4u, ntok - j)) {
            case 4: fp8_rows_avx2<Fp8Bits, 4>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, sc, o, os); break;
            case 3: fp8_rows_avx2<Fp8Bits, 3>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, sc, o, os); break;
            case 2: fp8_rows_avx2<Fp8Bits, 2>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, sc, o, os); break;
            default: fp8_rows_avx2<Fp8Bits, 1>(base, w.row_stride, sbase, ncb, w.cols, r0, r1, x + j, sc, o, os); break;
        }
    }
}
