// AVX-512 VNNI kernels for the K-quants. Per 256-element block the weights are
// unpacked once into four registers of 64 unsigned codes (Q4_K/Q5_K: the nibble
// order of the file, 0-31|64-95, 32-63|96-127, ...; Q6_K: natural order), their
// scales converted once to float, then every token's int8 block (laid out in the
// same order by prepare_q8_k) is multiplied with vpdpbusd and its integer sums scaled
// per lane by (weight scale x activation scale), spread over the lanes by vpermps.
// Mins (Q4_K/Q5_K) and the -32 offset (Q6_K) use the precomputed activation sums.
#pragma once

struct KqLaneIdx {
    __m512i q45[4], q6[4];
    KqLaneIdx() {
        alignas(64) int32_t t[16];
        static const int k45[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        for (int r = 0; r < 4; ++r) {
            for (int l = 0; l < 16; ++l) t[l] = k45[2 * r + l / 8];
            q45[r] = _mm512_load_si512(t);
            for (int l = 0; l < 16; ++l) t[l] = 4 * r + l / 4;
            q6[r] = _mm512_load_si512(t);
        }
    }
};

static inline void kq_scales_q45(const uint8_t* blk, __m256* S, __m256* M) {
    uint32_t u[4];
    std::memcpy(u, blk + 4, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t m03 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m03;
    u[0] &= k1;
    const __m128i v = _mm_loadu_si128((const __m128i*)u);  // bytes 0-7: scales, 8-15: mins
    const float d = _cvtsh_ss(*(const uint16_t*)blk), dmin = _cvtsh_ss(*(const uint16_t*)(blk + 2));
    *S = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(d));
    *M = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_set1_ps(dmin));
}

// One row against NT tokens; vres[j] holds token j's dot product spread over 16 lanes.
template <int FMT, int NT>
static inline void kq_row_avx512(const uint8_t* row, uint32_t nb, const BlockQ8xK* const* x, const KqLaneIdx& ix,
                                 __m512* vres) {
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    constexpr int U = NT == 1 ? 4 : (NT == 2 ? 2 : 1);  // accumulators per token (FMA latency)
    __m512 acc[NT][U], cacc[NT];
    for (int j = 0; j < NT; ++j) {
        cacc[j] = _mm512_setzero_ps();
        for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + (size_t)b * BB;
        __m512i wq[4];
        __m512 wsc;  // weight scales: Q4_K/Q5_K d*sc[8] (lanes 0-7), Q6_K d*sc[16]
        __m512 corr;  // per-lane weight of the activation sums (mins / -32 offset)
        if (FMT == FT_FMT_Q6_K) {
            const float d = _cvtsh_ss(*(const uint16_t*)(blk + 208));
            const __m512 G = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)))),
                                           _mm512_set1_ps(d));
            wsc = G;
            corr = _mm512_mul_ps(G, _mm512_set1_ps(-32.0f));
            const __m512i m3 = _mm512_set1_epi8(0x03);
            for (int n = 0; n < 2; ++n) {
                const __m512i l = _mm512_loadu_si512(blk + 64 * n);
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n)));
                const __m512i hl = _mm512_and_si512(_mm512_srlv_epi64(h, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), m3);
                const __m512i hh = _mm512_and_si512(_mm512_srlv_epi64(h, _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4)), m3);
                wq[2 * n] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(hl, 4));
                wq[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_slli_epi16(hh, 4));
            }
        } else {
            __m256 S, M;
            kq_scales_q45(blk, &S, &M);
            wsc = _mm512_castps256_ps512(S);
            corr = _mm512_castps256_ps512(_mm256_sub_ps(_mm256_setzero_ps(), M));
            const uint8_t* qs = blk + (FMT == FT_FMT_Q4_K ? 16 : 48);
            const __m512i q0 = _mm512_loadu_si512(qs), q1 = _mm512_loadu_si512(qs + 64);
            wq[0] = _mm512_and_si512(q0, m4);
            wq[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
            wq[2] = _mm512_and_si512(q1, m4);
            wq[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
            if (FMT == FT_FMT_Q5_K) {
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16)));
                const __m512i one = _mm512_set1_epi8(0x01);
                for (int r = 0; r < 4; ++r) {
                    // register r holds chunks c=2*(r/2) (low half) and c+1 (high half) of nibble r%2
                    const int bl = 2 * (2 * (r / 2)) + (r % 2), bh = bl + 2;
                    const __m512i cnt = _mm512_set_epi64(bh, bh, bh, bh, bl, bl, bl, bl);
                    const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(h, cnt), one);
                    wq[r] = _mm512_or_si512(wq[r], _mm512_slli_epi16(bit, 4));
                }
            }
        }
        for (int j = 0; j < NT; ++j) {
            const BlockQ8xK& xb = x[j][b];
            const int8_t* xq = FMT == FT_FMT_Q6_K ? xb.qs : xb.qs45;
            // token x weight scale per sub-block (Q4/Q5) or group of 16 (Q6), then spread over lanes
            const __m512 P = FMT == FT_FMT_Q6_K
                                 ? _mm512_mul_ps(wsc, _mm512_loadu_ps(xb.dx16))
                                 : _mm512_castps256_ps512(_mm256_mul_ps(_mm512_castps512_ps256(wsc), _mm256_loadu_ps(xb.d)));
            for (int r = 0; r < 4; ++r) {
                const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[r], _mm512_loadu_si512(xq + 64 * r));
                const __m512 coef = _mm512_permutexvar_ps(FMT == FT_FMT_Q6_K ? ix.q6[r] : ix.q45[r], P);
                acc[j][r % U] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), coef, acc[j][r % U]);
            }
            if (FMT == FT_FMT_Q6_K)
                cacc[j] = _mm512_fmadd_ps(corr, _mm512_loadu_ps(xb.xs16), cacc[j]);
            else
                cacc[j] = _mm512_fmadd_ps(corr, _mm512_castps256_ps512(_mm256_loadu_ps(xb.xs32)), cacc[j]);
        }
    }
    for (int j = 0; j < NT; ++j) {
        for (int u = 0; u < U; ++u) cacc[j] = _mm512_add_ps(cacc[j], acc[j][u]);
        vres[j] = cacc[j];
    }
}

template <int FMT>
static void dot_rows_kquant_avx512(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                   const void* const* xs, uint32_t ntok, float* out, size_t os) {
    static const KqLaneIdx ix;
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    const BlockQ8xK* xv[4];
    if (ntok == 1) {  // rows in groups of 16, summed together
        xv[0] = (const BlockQ8xK*)xs[0];
        __m512 v[16];
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            for (uint32_t i = 0; i < n; ++i)
                kq_row_avx512<FMT, 1>(base + (size_t)(g + i) * w.row_stride, nb, xv, ix, &v[i]);
            hsum16_avx512(v, (int)n, out + (g - r0));
        }
        return;
    }
    for (uint32_t j0 = 0; j0 < ntok; j0 += 4) {
        const uint32_t nt = ntok - j0 < 4 ? ntok - j0 : 4;
        for (uint32_t j = 0; j < nt; ++j) xv[j] = (const BlockQ8xK*)xs[j0 + j];
        for (uint32_t r = r0; r < r1; ++r) {
            const uint8_t* row = base + (size_t)r * w.row_stride;
            __m512 v[4];
            switch (nt) {
                case 4: kq_row_avx512<FMT, 4>(row, nb, xv, ix, v); break;
                case 3: kq_row_avx512<FMT, 3>(row, nb, xv, ix, v); break;
                case 2: kq_row_avx512<FMT, 2>(row, nb, xv, ix, v); break;
                default: kq_row_avx512<FMT, 1>(row, nb, xv, ix, v); break;
            }
            for (uint32_t j = 0; j < nt; ++j) out[(j0 + j) * os + (r - r0)] = _mm512_reduce_add_ps(v[j]);
        }
    }
}
