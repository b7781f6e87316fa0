// Preparation of float32 activations for the quantized dot products: symmetric
// int8 with a float scale per 32 elements (Q8_0 blocks; K-quant super-blocks of
// 256 also carry sums per 16 and per 32 for the mins / the Q6_K offset, and the int8
// values again in the AVX-512 kernels' register order). On the AVX2 tiers (avx2,
// avx_vnni) the K-quant super-blocks take one scale per 256 (absmax of the 256 / 127, as
// llama.cpp's Q8_K): their one-token kernels then add the sub-blocks' integer sums times
// the weights' integer scales over the whole super-block and convert once per block.
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

static inline int8_t quant_round(float v) {
    // round half away from zero, as the reference rounding of the test comments assumes
    float r = v >= 0.0f ? v + 0.5f : v - 0.5f;
    int q = (int)r;
    q = q > 127 ? 127 : (q < -127 ? -127 : q);
    return (int8_t)q;
}

static inline float absmax_span(const float* x, uint32_t n) {
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) { float a = x[i + l] < 0 ? -x[i + l] : x[i + l]; m[l] = m[l] > a ? m[l] : a; }
    float r = 0.0f;
    for (int l = 0; l < 8; ++l) r = r > m[l] ? r : m[l];
    for (; i < n; ++i) { float a = x[i] < 0 ? -x[i] : x[i]; r = r > a ? r : a; }
    return r;
}

#if defined(FT_HAVE_AVX2) && !defined(FT_HAVE_AVX512)
// AVX2 tiers: the same codes as quant_round, 8 lanes at a time: v * id plus 0.5 with the
// product's sign, truncated, clamped to +-127 (the same float operations lane by lane; the
// portable loop's branch on the sign mispredicted for every other element).
static inline __m256i quant8_avx2(__m256 v, __m256 id) {
    const __m256 t = _mm256_mul_ps(v, id);
    const __m256 half = _mm256_or_ps(_mm256_and_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u))),
                                     _mm256_set1_ps(0.5f));
    const __m256i q = _mm256_cvttps_epi32(_mm256_add_ps(t, half));
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

static inline int32_t hsum_epi32_avx2(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

static inline float hmax256_ps(__m256 m) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

// lane-wise absmax of n floats (n a multiple of 32)
static inline __m256 absmax_avx2(const float* x, uint32_t n) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    for (uint32_t i = 0; i < n; i += 16) {
        m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
        m1 = _mm256_max_ps(m1, _mm256_and_ps(_mm256_loadu_ps(x + i + 8), absmask));
    }
    return _mm256_max_ps(m0, m1);
}

// 32 floats -> their 32 int8 codes at q (x * id, rounded as quant_round); sums[0], sums[1]:
// the code sums of elements 0-15 and 16-31.
static inline void quant32_id_avx2(const float* x, __m256 id, int8_t* q, int32_t* sums) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
    __m256i c[4];
    for (int k = 0; k < 4; ++k) c[k] = quant8_avx2(v[k], id);
    // the packs work per 128-bit lane: their dwords hold codes 0-3, 8-11, 16-19, 24-27, 4-7, ...
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    sums[0] = hsum_epi32_avx2(_mm256_add_epi32(c[0], c[1]));
    sums[1] = hsum_epi32_avx2(_mm256_add_epi32(c[2], c[3]));
}

// 32 floats -> their 32 int8 codes at q (scale absmax / 127); sums as quant32_id_avx2.
// Returns absmax.
static inline float quant32_avx2(const float* x, int8_t* q, int32_t* sums) {
    const float amax = hmax256_ps(absmax_avx2(x, 32));
    quant32_id_avx2(x, _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), q, sums);
    return amax;
}
#endif

static void prepare_q8_32(const float* x, uint32_t n, void* out) {
    uint8_t* base = (uint8_t*)out;
    int8_t* qs = (int8_t*)base;
    float* d = (float*)(base + q8x32_d_offset(n));
    float* dq = d + n / 32;
#if defined(FT_HAVE_AVX2) && !defined(FT_HAVE_AVX512)
    for (uint32_t b = 0; b < n / 32; ++b) {
        int32_t sums[2];
        const float amax = quant32_avx2(x + (size_t)b * 32, qs + (size_t)b * 32, sums);
        d[b] = amax / 127.0f;
        dq[b] = d[b] * (float)(sums[0] + sums[1]);
    }
#else
    for (uint32_t b = 0; b < n / 32; ++b) {
        const float* xb = x + (size_t)b * 32;
        const float amax = absmax_span(xb, 32);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
            const int8_t q = quant_round(xb[i] * id);
            qs[(size_t)b * 32 + i] = q;
            sum += q;
        }
        d[b] = amax / 127.0f;
        dq[b] = d[b] * (float)sum;
    }
#endif
}

#if defined(FT_HAVE_AVX512)
// int8 codes of 16 floats: v * id rounded half away from zero, clamped to +-127
// (quant_round, lane by lane: the same float operations give the same codes).
static inline __m512i quant16_avx512(__m512 v, __m512 id) {
    const __m512 t = _mm512_mul_ps(v, id);
    const __m512 half = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(t), _mm512_set1_epi32(0x80000000), _mm512_set1_epi32(0x3f000000), 0xEA));  // +-0.5
    const __m512i q = _mm512_cvttps_epi32(_mm512_add_ps(t, half));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}
#endif

// Codes, scales and group sums of one 256-block (qs, d, bsums).
static inline void quant_block_q8_k(const float* xb, BlockQ8xK& o) {
#if defined(FT_HAVE_AVX512)
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int s = 0; s < 8; ++s) {
        const __m512 v0 = _mm512_loadu_ps(xb + 32 * s), v1 = _mm512_loadu_ps(xb + 32 * s + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = quant16_avx512(v0, id), q1 = quant16_avx512(v1, id);
        _mm_storeu_si128((__m128i*)(o.qs + 32 * s), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(o.qs + 32 * s + 16), _mm512_cvtsepi32_epi8(q1));
        o.bsums[2 * s] = (int16_t)_mm512_reduce_add_epi32(q0);
        o.bsums[2 * s + 1] = (int16_t)_mm512_reduce_add_epi32(q1);
        o.d[s] = amax / 127.0f;
    }
#elif defined(FT_HAVE_AVX2)
    // one scale for the whole super-block (see the top of the file)
    const float amax = hmax256_ps(absmax_avx2(xb, 256));
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int s = 0; s < 8; ++s) {
        int32_t sums[2];
        quant32_id_avx2(xb + 32 * s, id, o.qs + 32 * s, sums);
        o.d[s] = amax / 127.0f;
        o.bsums[2 * s] = (int16_t)sums[0];
        o.bsums[2 * s + 1] = (int16_t)sums[1];
    }
#else
    for (int s = 0; s < 8; ++s) {
        const float* xs = xb + 32 * s;
        const float amax = absmax_span(xs, 32);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; ++i) o.qs[32 * s + i] = quant_round(xs[i] * id);
        o.d[s] = amax / 127.0f;
    }
    for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += o.qs[g * 16 + i];
        o.bsums[g] = (int16_t)sum;
    }
#endif
}

static void prepare_q8_k(const float* x, uint32_t n, BlockQ8xK* out) {
#if defined(FT_HAVE_AVX512)
    // qs4k as a permutation of the dwords of qs (kq45_act_index moves whole dwords):
    // output register r takes dword 16 (l / 8) + (l' % 8) + 8 (l & 1) of its 128-byte
    // half, l' = l for A (r even), l ^ 1 for B (r odd)
    alignas(64) int32_t ia[16], ib[16];
    for (int l = 0; l < 16; ++l) {
        ia[l] = 16 * (l / 8) + (l % 8) + 8 * (l & 1);
        ib[l] = 16 * (l / 8) + ((l ^ 1) % 8) + 8 * (l & 1);
    }
    const __m512i idx_a = _mm512_load_si512(ia), idx_b = _mm512_load_si512(ib);
#endif
    for (uint32_t b = 0; b < n / 256; ++b) {
        BlockQ8xK& o = out[b];
        quant_block_q8_k(x + (size_t)b * 256, o);
        for (int g = 0; g < 16; ++g) {
            o.xs16[g] = o.d[g / 2] * (float)o.bsums[g];
            o.dx16[g] = g % 8 >= 6 ? o.d[g / 2] * 0.25f : o.d[g / 2];
        }
        for (int s = 0; s < 8; ++s) {
            o.bsums32[s] = (int16_t)((int)o.bsums[2 * s] + (int)o.bsums[2 * s + 1]);
            o.xs32[s] = o.d[s] * (float)o.bsums32[s];
            // odd sub-blocks are the high nibbles, which the kernels multiply as 16x
            // (Q4_K) or 8x (Q5_K) the code: exact powers of two, undone here
            o.xdm4[2 * s] = (s & 1) ? o.d[s] * 0.0625f : o.d[s];
            o.xdm5[2 * s] = (s & 1) ? o.d[s] * 0.125f : o.d[s];
            o.xdm4[2 * s + 1] = o.xdm5[2 * s + 1] = -o.xs32[s];
        }
#if defined(FT_HAVE_AVX512)
        for (int h = 0; h < 2; ++h) {
            const __m512i n0 = _mm512_loadu_si512(o.qs + 128 * h), n1 = _mm512_loadu_si512(o.qs + 128 * h + 64);
            _mm512_storeu_si512(o.qs4k + 128 * h, _mm512_permutex2var_epi32(n0, idx_a, n1));
            _mm512_storeu_si512(o.qs4k + 128 * h + 64, _mm512_permutex2var_epi32(n0, idx_b, n1));
        }
#elif defined(FT_HAVE_AVX2)
        // the AVX2 tiers' kernels read the natural order only
        std::memset(o.qs4k, 0, sizeof o.qs4k);
#else
        for (uint32_t i = 0; i < 256; ++i) o.qs4k[i] = o.qs[kq45_act_index(i)];
#endif
        for (int i = 0; i < 4; ++i) o.pad[i] = 0.0f;
    }
}

static void prepare_any(int kind, const float* x, uint32_t n, void* out) {
    switch (kind) {
        case ACT_F32: std::memcpy(out, x, (size_t)n * 4); break;
        case ACT_Q8_32: prepare_q8_32(x, n, out); break;
        case ACT_Q8_K: prepare_q8_k(x, n, (BlockQ8xK*)out); break;
        default: break;
    }
}
