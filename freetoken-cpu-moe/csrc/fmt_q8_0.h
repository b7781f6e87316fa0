// GGUF Q8_0 weights (fp16 d + int8 qs[32] per 32 elements) against int8
// activations (ACT_Q8_32, a float scale per 32). Included inside an ISA
// namespace by isa_*.cpp.
#pragma once

static inline int32_t dot_i8x32_portable(const int8_t* a, const int8_t* b) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

static inline float q8_0_row_portable(const uint8_t* row, const ActQ8x32View& x, uint32_t b0, uint32_t b1) {
    float acc = 0.0f;
    for (uint32_t b = b0; b < b1; ++b) {
        const uint8_t* p = row + (size_t)b * Q8_0_BYTES;
        uint16_t h;
        std::memcpy(&h, p, 2);
        acc += half_to_float(h) * x.d[b] * (float)dot_i8x32_portable((const int8_t*)(p + 2), x.qs + (size_t)b * 32);
    }
    return acc;
}

#if defined(FT_HAVE_AVX512)
#ifndef FT_Q8_PREFETCH
#define FT_Q8_PREFETCH 2176  // bytes ahead: four groups of 16 blocks
#endif
// NT tokens against one row. Per group of 16 blocks: the weights' fp16 scales are
// gathered once; per pair of blocks one 512-bit dpbusd on (w + 128) (unsigned)
// against x, the 128 * sum(x) excess removed through dq = d * sum(qs).
template <int NT>
static inline void q8_0_row_avx512(const uint8_t* row, const ActQ8x32View* x, uint32_t nb, __m512* vres) {
    constexpr int U = NT == 1 ? 2 : 1;  // accumulators per token (FMA latency)
    __m512 acc[NT][U], corr[NT];
    for (int j = 0; j < NT; ++j) {
        corr[j] = _mm512_setzero_ps();
        for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
    }
    const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)Q8_0_BYTES));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (uint32_t b = 0; b < nb; b += 16) {
        const uint32_t m = nb - b < 16 ? nb - b : 16;  // blocks in this group
        const __mmask16 mk = (__mmask16)((1u << m) - 1u);
        const uint8_t* g = row + (size_t)b * Q8_0_BYTES;
        // the gather below would otherwise be the first touch of these lines and wait
        // for memory with little parallelism: fetch the next group's lines ahead
        for (int o = 0; o < 16 * (int)Q8_0_BYTES; o += 64) _mm_prefetch((const char*)g + FT_Q8_PREFETCH + o, _MM_HINT_T0);
        const __m512i dh = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, gidx, (const void*)g, 1);
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
        __m512 coef[NT];
        for (int j = 0; j < NT; ++j) {
            coef[j] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mk, x[j].d + b));
            corr[j] = _mm512_fmadd_ps(dw, _mm512_maskz_loadu_ps(mk, x[j].dq + b), corr[j]);
        }
        for (uint32_t k = 0; 2 * k < m; ++k) {
            const bool pair = 2 * k + 1 < m;
            const uint8_t* p0 = g + (size_t)(2 * k) * Q8_0_BYTES + 2;
            const __m256i hi = pair ? _mm256_loadu_si256((const __m256i*)(p0 + Q8_0_BYTES)) : _mm256_setzero_si256();
            __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)), hi, 1);
            wq = _mm512_xor_si512(wq, flip);
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
// AVX2 tiers, few tokens (more take the tiles of block32_tiles_avx2.h): |w| (unsigned, <= 128)
// x sign-adjusted x through dot4_u8i8 (no saturation: 2 x 128 x 127 < 32768), one float
// scale per block; the weight stream prefetched 2 KB ahead.
template <int NT>
static inline void q8_0_row_avx2(const uint8_t* row, const ActQ8x32View* x, uint32_t nb, float* res) {
    constexpr int U = NT == 1 ? 2 : 1;  // blocks per iteration, each into its own accumulators (FMA latency)
    __m256 acc[U][NT];
    for (int u = 0; u < U; ++u)
        for (int j = 0; j < NT; ++j) acc[u][j] = _mm256_setzero_ps();
    auto block = [&](uint32_t b, __m256* a) {
        const uint8_t* p = row + (size_t)b * Q8_0_BYTES;
        const __m256i wq = _mm256_loadu_si256((const __m256i*)(p + 2));
        const __m256i aw = _mm256_sign_epi8(wq, wq);
        const float dw = _cvtsh_ss(*(const uint16_t*)p);
        for (int j = 0; j < NT; ++j) {
            const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x[j].qs + (size_t)b * 32)), wq);
            a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4_u8i8(aw, xq)), _mm256_set1_ps(dw * x[j].d[b]), a[j]);
        }
    };
    uint32_t b = 0;
    for (; b + U <= nb; b += U) {
        _mm_prefetch((const char*)row + (size_t)b * Q8_0_BYTES + 2048, _MM_HINT_T0);
        for (int u = 0; u < U; ++u) block(b + u, acc[u]);
    }
    for (; b < nb; ++b) block(b, acc[0]);
    for (int j = 0; j < NT; ++j) {
        for (int u = 1; u < U; ++u) acc[0][j] = _mm256_add_ps(acc[0][j], acc[u][j]);
        res[j] = hsum256(acc[0][j]);
    }
}

// Tokens per call from which the tiles take over from the row kernel. One thread, weights in L2,
// GB/s x tokens, row / tiles: avx2 T=3 60 / 51, T=4 62 / 58, T=6 61 / 69 (each step of the
// tiles costs two multiplies, the sign trick, as the row kernel's); avx_vnni T=3 68 / 79,
// T=4 72 / 91. One threshold for both tiers, so that they take the same path and agree bit
// for bit.
constexpr uint32_t kQ8TileMinTokens = 4;
#endif

static void dot_rows_q8_0(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                          const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK8_0;
    ActQ8x32View xv[4];
#if defined(FT_HAVE_AVX512)
    if (ntok == 1) {  // rows in groups of 16, summed together
        xv[0] = q8x32_view(xs[0], w.cols);
        __m512 v[16];
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            for (uint32_t i = 0; i < n; ++i) q8_0_row_avx512<1>(base + (size_t)(g + i) * w.row_stride, xv, nb, &v[i]);
            hsum16_avx512(v, (int)n, out + (g - r0));
        }
        return;
    }
    // Many tokens: rows in groups of 16 against every group of 8 tokens, each token's 16
    // sums reduced together (short rows, e.g. a 128-column head of attn_k_b, spend less on
    // the reductions and on each row's scale gather than on the products)
    for (uint32_t j0 = 0; j0 < ntok; j0 += 8) {
        const uint32_t nt = ntok - j0 < 8 ? ntok - j0 : 8;
        ActQ8x32View xw[8];
        for (uint32_t j = 0; j < nt; ++j) xw[j] = q8x32_view(xs[j0 + j], w.cols);
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            __m512 v[8][16];
            for (uint32_t i = 0; i < n; ++i) {
                const uint8_t* row = base + (size_t)(g + i) * w.row_stride;
                __m512 r[8];
                switch (nt) {
                    case 8: q8_0_row_avx512<8>(row, xw, nb, r); break;
                    case 7: q8_0_row_avx512<7>(row, xw, nb, r); break;
                    case 6: q8_0_row_avx512<6>(row, xw, nb, r); break;
                    case 5: q8_0_row_avx512<5>(row, xw, nb, r); break;
                    case 4: q8_0_row_avx512<4>(row, xw, nb, r); break;
                    case 3: q8_0_row_avx512<3>(row, xw, nb, r); break;
                    case 2: q8_0_row_avx512<2>(row, xw, nb, r); break;
                    default: q8_0_row_avx512<1>(row, xw, nb, r); break;
                }
                for (uint32_t j = 0; j < nt; ++j) v[j][i] = r[j];
            }
            for (uint32_t j = 0; j < nt; ++j) hsum16_avx512(v[j], (int)n, out + (j0 + j) * os + (g - r0));
        }
    }
    return;
#endif
#if defined(FT_HAVE_AVX2) && !defined(FT_HAVE_AVX512)
    if (ntok >= kQ8TileMinTokens) {
        dot_rows_b32_tiles<FT_FMT_Q8_0>(w, e, r0, r1, xs, ntok, out, os);
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
                case 4: q8_0_row_avx512<4>(row, xv, nb, v); break;
                case 3: q8_0_row_avx512<3>(row, xv, nb, v); break;
                case 2: q8_0_row_avx512<2>(row, xv, nb, v); break;
                default: q8_0_row_avx512<1>(row, xv, nb, v); break;
            }
            for (uint32_t j = 0; j < nt; ++j) res[j] = _mm512_reduce_add_ps(v[j]);
#elif defined(FT_HAVE_AVX2)
            switch (nt) {
                case 4: q8_0_row_avx2<4>(row, xv, nb, res); break;
                case 3: q8_0_row_avx2<3>(row, xv, nb, res); break;
                case 2: q8_0_row_avx2<2>(row, xv, nb, res); break;
                default: q8_0_row_avx2<1>(row, xv, nb, res); break;
            }
#else
            for (uint32_t j = 0; j < nt; ++j) res[j] = q8_0_row_portable(row, xv[j], 0, nb);
#endif
            for (uint32_t j = 0; j < nt; ++j) out[(j0 + j) * os + (r - r0)] = res[j];
        }
    }
}
