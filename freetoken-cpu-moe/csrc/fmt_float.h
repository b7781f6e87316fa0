// Float weight formats (F32, F16, BF16, FP8 E4M3 with 128x128 block scales)
// against float32 activations. Included inside an ISA namespace by isa_*.cpp:
// the portable loops are vectorised by the compiler with that file's flags, and
// FT_HAVE_AVX512 sections add hand-written kernels; the AVX2 tiers take theirs from
// fmt_float_avx2.h (kernels_isa.inc includes it after this file).
#pragma once

// Portable element loaders.
struct LoadF32 { static float at(const uint8_t* p, uint32_t i) { float v; std::memcpy(&v, p + 4 * (size_t)i, 4); return v; } };
struct LoadF16 { static float at(const uint8_t* p, uint32_t i) { uint16_t h; std::memcpy(&h, p + 2 * (size_t)i, 2); return half_to_float(h); } };
struct LoadBF16 { static float at(const uint8_t* p, uint32_t i) { uint16_t h; std::memcpy(&h, p + 2 * (size_t)i, 2); return bf16_to_float(h); } };
struct LoadFP8 { static float at(const uint8_t* p, uint32_t i) { return fp8_e4m3_to_float(p[i]); } };

// dot of n weights (format L) starting at element c0 of row with x[c0..c0+n)
template <class L>
static inline float dot_span_portable(const uint8_t* row, const float* x, uint32_t c0, uint32_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int l = 0; l < 8; ++l) acc[l] += L::at(row, c0 + c + l) * x[c0 + c + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; c < n; ++c) s += L::at(row, c0 + c) * x[c0 + c];
    return s;
}

#if defined(FT_HAVE_AVX512)
// 16 weights -> float32 lanes
static inline __m512 load16_f32(const uint8_t* p) { return _mm512_loadu_ps((const float*)p); }
static inline __m512 load16_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 load16_bf16(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// E4M3 -> f16 bits (value / 2^8): sign-extend the byte to 16 bits and shift left by
// 7, which puts the sign in bit 15 and exponent/mantissa in bits 13..7; bit 14
// (a copy of the sign) is cleared. Subnormal E4M3 codes become subnormal f16, exactly.
// The caller folds 2^8 into the block scale. NaN codes do not occur in checkpoints.
static inline __m256i fp8_to_f16_bits(__m128i b16) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b16), 7), _mm256_set1_epi16((short)0xBF80));
}
static inline __m512 load16_fp8_div256(const uint8_t* p) {
    return _mm512_cvtph_ps(fp8_to_f16_bits(_mm_loadu_si128((const __m128i*)p)));
}
// Software prefetch distance of the weight stream, in bytes (as the K-quants' and Q8_0's):
// a core that converts and multiplies between its loads keeps too few lines in flight with
// the hardware prefetchers alone. Rows of one matrix are contiguous, so the prefetches run
// ahead over row ends.
#ifndef FT_FLOAT_PREFETCH
#define FT_FLOAT_PREFETCH 2048
#endif
static inline void float_prefetch(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + FT_FLOAT_PREFETCH + o, _MM_HINT_T0);
}
// U independent accumulators per token hide the FMA latency when few tokens share a row.
#define FT_FLOAT_KERNEL(NAME, LOAD, ESZ)                                                          \
    template <int NT>                                                                             \
    static inline void NAME##_vtile(const uint8_t* row, const float* const* x, uint32_t c0,       \
                                    uint32_t n, __m512* vres) {                                   \
        constexpr int U = NT == 1 ? 4 : (NT == 2 ? 2 : 1);                                        \
        __m512 acc[NT][U];                                                                        \
        for (int j = 0; j < NT; ++j)                                                              \
            for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();                          \
        uint32_t c = 0;                                                                           \
        for (; c + 16 * U <= n; c += 16 * U) {                                                    \
            float_prefetch(row + (size_t)(c0 + c) * ESZ, 16 * U * ESZ);                           \
            for (int u = 0; u < U; ++u) {                                                         \
                __m512 wv = LOAD(row + (size_t)(c0 + c + 16 * u) * ESZ);                         \
                for (int j = 0; j < NT; ++j)                                                      \
                    acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[j] + c0 + c + 16 * u), acc[j][u]); \
            }                                                                                     \
        }                                                                                         \
        for (; c + 16 <= n; c += 16) {                                                            \
            __m512 wv = LOAD(row + (size_t)(c0 + c) * ESZ);                                      \
            for (int j = 0; j < NT; ++j) acc[j][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[j] + c0 + c), acc[j][0]); \
        }                                                                                         \
        if (c < n) {                                                                              \
            __mmask16 m = (__mmask16)((1u << (n - c)) - 1u);                                      \
            __m512 wv = LOAD##_tail(row + (size_t)(c0 + c) * ESZ, m);                             \
            for (int j = 0; j < NT; ++j) acc[j][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x[j] + c0 + c), acc[j][0]); \
        }                                                                                         \
        for (int j = 0; j < NT; ++j) {                                                            \
            for (int u = 1; u < U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);          \
            vres[j] = acc[j][0];                                                                  \
        }                                                                                         \
    }                                                                                             \
    template <int NT>                                                                             \
    static inline void NAME##_tile(const uint8_t* row, const float* const* x, uint32_t c0,        \
                                   uint32_t n, float* res) {                                      \
        __m512 v[NT];                                                                             \
        NAME##_vtile<NT>(row, x, c0, n, v);                                                       \
        for (int j = 0; j < NT; ++j) res[j] = _mm512_reduce_add_ps(v[j]);                         \
    }
static inline __m512 load16_f32_tail(const uint8_t* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16_f16_tail(const uint8_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline __m512 load16_bf16_tail(const uint8_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 load16_fp8_div256_tail(const uint8_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(fp8_to_f16_bits(_mm_maskz_loadu_epi8(m, p)));
}
FT_FLOAT_KERNEL(k_f32, load16_f32, 4)
FT_FLOAT_KERNEL(k_f16, load16_f16, 2)
FT_FLOAT_KERNEL(k_bf16, load16_bf16, 2)
FT_FLOAT_KERNEL(k_fp8, load16_fp8_div256, 1)
#define FT_FLOAT_SIMD 1
#elif !defined(FT_HAVE_AVX2)  // (the AVX2 tiers' kernels: fmt_float_avx2.h)
#define FT_FLOAT_KERNEL(NAME, PORT, SCALE)                                                        \
    template <int NT>                                                                             \
    static inline void NAME##_tile(const uint8_t* row, const float* const* x, uint32_t c0,        \
                                   uint32_t n, float* res) {                                      \
        for (int j = 0; j < NT; ++j) res[j] = dot_span_portable<PORT>(row, x[j], c0, n) * SCALE;  \
    }
FT_FLOAT_KERNEL(k_f32, LoadF32, 1.0f)
FT_FLOAT_KERNEL(k_f16, LoadF16, 1.0f)
FT_FLOAT_KERNEL(k_bf16, LoadBF16, 1.0f)
FT_FLOAT_KERNEL(k_fp8, LoadFP8, 0x1p-8f)
#endif

// Rows [r0, r1) of a float-format weight against NT tokens at a time.
#if defined(FT_HAVE_AVX512)
#define FT_VTILE_PARAM , void (*VTILE1)(const uint8_t*, const float* const*, uint32_t, uint32_t, __m512*)
#else
#define FT_VTILE_PARAM
#endif
template <void (*TILE1)(const uint8_t*, const float* const*, uint32_t, uint32_t, float*),
          void (*TILE2)(const uint8_t*, const float* const*, uint32_t, uint32_t, float*),
          void (*TILE4)(const uint8_t*, const float* const*, uint32_t, uint32_t, float*) FT_VTILE_PARAM>
static void dot_rows_float(const uint8_t* base, size_t row_stride, uint32_t cols, uint32_t r0, uint32_t r1,
                           const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const float* const* x = (const float* const*)xs;
#if defined(FT_HAVE_AVX512)
    if (ntok == 1) {  // rows in groups of 16, summed together
        __m512 v[16];
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            for (uint32_t i = 0; i < n; ++i) VTILE1(base + (size_t)(g + i) * row_stride, x, 0, cols, &v[i]);
            hsum16_avx512(v, (int)n, out + (g - r0));
        }
        return;
    }
#endif
    for (uint32_t r = r0; r < r1; ++r) {
        const uint8_t* row = base + (size_t)r * row_stride;
        uint32_t j = 0;
        float res[4];
        for (; j + 4 <= ntok; j += 4) {
            TILE4(row, x + j, 0, cols, res);
            for (int q = 0; q < 4; ++q) out[(j + q) * os + (r - r0)] = res[q];
        }
        for (; j + 2 <= ntok; j += 2) {
            TILE2(row, x + j, 0, cols, res);
            for (int q = 0; q < 2; ++q) out[(j + q) * os + (r - r0)] = res[q];
        }
        for (; j < ntok; ++j) {
            TILE1(row, x + j, 0, cols, res);
            out[j * os + (r - r0)] = res[0];
        }
    }
}

#if defined(FT_HAVE_AVX512)
// FP8 rows against NT tokens: per 128-column block, accumulate in vectors, then
// fold the block's scale into per-token vector totals (one reduction per row).
template <int NT>
static inline void fp8_row_avx512(const uint8_t* row, const float* srow, const float* const* x, uint32_t cols, float* res) {
    constexpr int U = NT == 1 ? 2 : 1;  // 32-element steps in flight per token (2 accumulators each)
    __m512 tot[NT];
    for (int j = 0; j < NT; ++j) tot[j] = _mm512_setzero_ps();
    for (uint32_t c0 = 0, cb = 0; c0 < cols; c0 += FP8_BLOCK, ++cb) {
        const uint32_t n = cols - c0 < FP8_BLOCK ? cols - c0 : FP8_BLOCK;
        __m512 acc[NT][2 * U];
        for (int j = 0; j < NT; ++j)
            for (int u = 0; u < 2 * U; ++u) acc[j][u] = _mm512_setzero_ps();
        uint32_t c = 0;
        for (; c + 32 * U <= n; c += 32 * U) {
            float_prefetch(row + c0 + c, 32 * U);
            for (int u = 0; u < U; ++u) {
                const __m512i h = _mm512_and_si512(
                    _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(row + c0 + c + 32 * u))), 7),
                    _mm512_set1_epi16((short)0xBF80));
                const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
                const __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
                for (int j = 0; j < NT; ++j) {
                    const float* xp = x[j] + c0 + c + 32 * u;
                    acc[j][2 * u] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[j][2 * u]);
                    acc[j][2 * u + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc[j][2 * u + 1]);
                }
            }
        }
        for (; c < n; c += 16) {
            const uint32_t k = n - c < 16 ? n - c : 16;
            const __mmask16 m = (__mmask16)((1u << k) - 1u);
            const __m512 wv = load16_fp8_div256_tail(row + c0 + c, m);
            for (int j = 0; j < NT; ++j) acc[j][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x[j] + c0 + c), acc[j][0]);
        }
        const __m512 sv = _mm512_set1_ps(srow[cb] * 256.0f);
        for (int j = 0; j < NT; ++j) {
            for (int u = 1; u < 2 * U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
            tot[j] = _mm512_fmadd_ps(acc[j][0], sv, tot[j]);
        }
    }
    for (int j = 0; j < NT; ++j) res[j] = _mm512_reduce_add_ps(tot[j]);
}
#endif

#if !defined(FT_HAVE_AVX2)  // (the AVX2 tiers: dot_rows_fp8_avx2 in fmt_float_avx2.h)
// FP8: the dot runs per 128-column block, each weighted by its block scale.
static void dot_rows_fp8(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                         const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const float* sbase = (const float*)((const uint8_t*)(uintptr_t)w.scale + (size_t)e * w.scale_expert_stride);
    const uint32_t ncb = (w.cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const float* const* x = (const float* const*)xs;
    for (uint32_t j = 0; j < ntok; j += 4) {
        const uint32_t nt = (ntok - j) < 4 ? (ntok - j) : 4;
        for (uint32_t r = r0; r < r1; ++r) {
            const uint8_t* row = base + (size_t)r * w.row_stride;
            const float* srow = sbase + (size_t)(r / FP8_BLOCK) * ncb;
            float res[4];
#if defined(FT_HAVE_AVX512)
            switch (nt) {
                case 4: fp8_row_avx512<4>(row, srow, x + j, w.cols, res); break;
                case 3: fp8_row_avx512<3>(row, srow, x + j, w.cols, res); break;
                case 2: fp8_row_avx512<2>(row, srow, x + j, w.cols, res); break;
                default: fp8_row_avx512<1>(row, srow, x + j, w.cols, res); break;
            }
#else
            float acc[4] = {0, 0, 0, 0};
            for (uint32_t cb = 0; cb < ncb; ++cb) {
                const uint32_t c0 = cb * FP8_BLOCK;
                const uint32_t n = (w.cols - c0) < FP8_BLOCK ? (w.cols - c0) : FP8_BLOCK;
                const float s = srow[cb] * 256.0f;
                if (nt == 4) k_fp8_tile<4>(row, x + j, c0, n, res);
                else if (nt >= 2) k_fp8_tile<2>(row, x + j, c0, n, res);
                else k_fp8_tile<1>(row, x + j, c0, n, res);
                if (nt == 3) { float r3; k_fp8_tile<1>(row, x + j + 2, c0, n, &r3); res[2] = r3; }
                for (uint32_t q = 0; q < nt; ++q) acc[q] += res[q] * s;
            }
            for (uint32_t q = 0; q < nt; ++q) res[q] = acc[q];
#endif
            for (uint32_t q = 0; q < nt; ++q) out[(j + q) * os + (r - r0)] = res[q];
        }
    }
}
#endif
