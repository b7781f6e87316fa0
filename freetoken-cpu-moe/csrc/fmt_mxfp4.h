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
// NT tokens against one row. Per group of 16 blocks the exponents are gathered once
// and turned into float scales with integer ops; per pair of blocks one register
// holds [lo(q0), hi(q0), lo(q1), hi(q1)] (the nibbles of two broadcast 16-byte loads,
// odd 128-bit lanes shifted down by 4), i.e. the 64 elements in natural order, looked
// up with vpshufb as value + 128 (unsigned) and multiplied with x by one dpbusd; the
// 128 * sum(x) excess is removed through dq = d * sum(qs), as for Q8_0.
template <int NT>
static inline void mxfp4_row_avx512(const uint8_t* row, const ActQ8x32View* x, uint32_t nb, __m512* vres) {
    constexpr int U = NT == 1 ? 2 : 1;  // accumulators per token (FMA latency)
    __m512 acc[NT][U], corr[NT];
    for (int j = 0; j < NT; ++j) {
        corr[j] = _mm512_setzero_ps();
        for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
    }
    const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)MXFP4_BYTES));
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132,
                                                             (char)134, (char)136, (char)140, (char)128, (char)127,
                                                             (char)126, (char)125, (char)124, (char)122, (char)120,
                                                             (char)116));
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi32(1), byte = _mm512_set1_epi32(0xFF);
    for (uint32_t b = 0; b < nb; b += 16) {
        const uint32_t m = nb - b < 16 ? nb - b : 16;  // blocks in this group
        const __mmask16 mk = (__mmask16)((1u << m) - 1u);
        const uint8_t* g = row + (size_t)b * MXFP4_BYTES;
        for (int o = 0; o < 16 * (int)MXFP4_BYTES; o += 64) _mm_prefetch((const char*)g + FT_MXFP4_PREFETCH + o, _MM_HINT_T0);
        const __m512i eb = _mm512_and_si512(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, gidx, (const void*)g, 1), byte);
        // float bits (e - 1) << 23 = 2^(e - 128); e < 2 -> 0
        const __m512 dw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_max_epi32(_mm512_sub_epi32(eb, one), _mm512_setzero_si512()), 23));
        __m512 coef[NT];
        for (int j = 0; j < NT; ++j) {
            coef[j] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mk, x[j].d + b));
            corr[j] = _mm512_fmadd_ps(dw, _mm512_maskz_loadu_ps(mk, x[j].dq + b), corr[j]);
        }
        for (uint32_t k = 0; 2 * k < m; ++k) {
            const bool pair = 2 * k + 1 < m;
            const uint8_t* p0 = g + (size_t)(2 * k) * MXFP4_BYTES + 1;
            __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p0));
            if (pair) z = _mm512_mask_broadcast_i32x4(z, (__mmask16)0xFF00, _mm_loadu_si128((const __m128i*)(p0 + MXFP4_BYTES)));
            z = _mm512_and_si512(_mm512_mask_srli_epi16(z, (__mmask32)0xFF00FF00u, z, 4), m4);
            const __m512i wq = _mm512_shuffle_epi8(lut, z);
            const __m512i sel = _mm512_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                                 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k);
            const __mmask64 xm = pair ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
            for (int j = 0; j < NT; ++j) {
                const __m512i xq = _mm512_maskz_loadu_epi8(xm, x[j].qs + (size_t)(b + 2 * k) * 32);
                const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
                acc[j][k % U] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(sel, coef[j]), acc[j][k % U]);
            }
        }
    }
    for (int j = 0; j < NT; ++j) {
        for (int u = 1; u < U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
        vres[j] = _mm512_fmadd_ps(corr[j], _mm512_set1_ps(-128.0f), acc[j][0]);
    }
}
#endif

#if defined(FT_HAVE_AVX2) && !defined(FT_HAVE_AVX512)
// AVX2: the 32 codes of a block as [lo | hi] nibbles, int8 values by vpshufb, then
// |w| x sign-adjusted x with vpmaddubsw (|w| <= 12: no saturation), pairs to int32.
template <int NT>
static inline void mxfp4_row_avx2(const uint8_t* row, const ActQ8x32View* x, uint32_t nb, float* res) {
    __m256 acc[NT];
    for (int j = 0; j < NT; ++j) acc[j] = _mm256_setzero_ps();
    const __m128i lut128 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i lut = _mm256_set_m128i(lut128, lut128);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + (size_t)b * MXFP4_BYTES;
        const __m128i q = _mm_loadu_si128((const __m128i*)(p + 1));
        const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
        const __m256i wq = _mm256_shuffle_epi8(lut, codes);
        const __m256i aw = _mm256_sign_epi8(wq, wq);
        const float dw = mxfp4_scale(p[0]);
        for (int j = 0; j < NT; ++j) {
            const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x[j].qs + (size_t)b * 32)), wq);
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xq), ones);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * x[j].d[b]), acc[j]);
        }
    }
    for (int j = 0; j < NT; ++j) res[j] = hsum256(acc[j]);
}
#endif

static void dot_rows_mxfp4(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                           const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_MXFP4;
    ActQ8x32View xv[4];
#if defined(FT_HAVE_AVX512)
    if (ntok == 1) {  // rows in groups of 16, summed together
        xv[0] = q8x32_view(xs[0], w.cols);
        __m512 v[16];
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            for (uint32_t i = 0; i < n; ++i) mxfp4_row_avx512<1>(base + (size_t)(g + i) * w.row_stride, xv, nb, &v[i]);
            hsum16_avx512(v, (int)n, out + (g - r0));
        }
        return;
    }
#endif
    for (uint32_t j0 = 0; j0 < ntok; j0 += 4) {
        const uint32_t nt = ntok - j0 < 4 ? ntok - j0 : 4;
        for (uint32_t j = 0; j < nt; ++j) xv[j] = q8x32_view(xs[j0 + j], w.cols);
        for (uint32_t r = r0; r < r1; ++r) {
            const uint8_t* row = base + (size_t)r * w.row_stride;
            float res[4];
#if defined(FT_HAVE_AVX512)
            __m512 v[4];
            switch (nt) {
                case 4: mxfp4_row_avx512<4>(row, xv, nb, v); break;
                case 3: mxfp4_row_avx512<3>(row, xv, nb, v); break;
                case 2: mxfp4_row_avx512<2>(row, xv, nb, v); break;
                default: mxfp4_row_avx512<1>(row, xv, nb, v); break;
            }
            for (uint32_t j = 0; j < nt; ++j) res[j] = _mm512_reduce_add_ps(v[j]);
#elif defined(FT_HAVE_AVX2)
            switch (nt) {
                case 4: mxfp4_row_avx2<4>(row, xv, nb, res); break;
                case 3: mxfp4_row_avx2<3>(row, xv, nb, res); break;
                case 2: mxfp4_row_avx2<2>(row, xv, nb, res); break;
                default: mxfp4_row_avx2<1>(row, xv, nb, res); break;
            }
#else
            for (uint32_t j = 0; j < nt; ++j) res[j] = mxfp4_row_portable(row, xv[j], nb);
#endif
            for (uint32_t j = 0; j < nt; ++j) out[(j0 + j) * os + (r - r0)] = res[j];
        }
    }
}
