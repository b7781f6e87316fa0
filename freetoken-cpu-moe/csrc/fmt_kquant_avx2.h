// AVX2 kernels for the K-quants with few tokens per row: unsigned codes x int8 activations
// through dot4_u8i8 (dot_i8_avx2.h: vpmaddubsw + vpmaddwd, or vpdpbusd on avx_vnni; codes
// below 64, so both tiers sum exactly alike). With 256-bit registers each register is one
// sub-block of 32 in natural order, so the activations are read as they are. Calls with
// more tokens take the tiles of kquant_tiles_avx2.h.
#pragma once

static inline __m256 kq2_scales_q45(const uint8_t* blk, __m256* M) {
    uint32_t u[4];
    std::memcpy(u, blk + 4, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t m03 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m03;
    u[0] &= k1;
    const __m128i v = _mm_loadu_si128((const __m128i*)u);
    const float d = _cvtsh_ss(*(const uint16_t*)blk), dmin = _cvtsh_ss(*(const uint16_t*)(blk + 2));
    *M = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_set1_ps(dmin));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(d));
}

template <int FMT, int NT>
static inline void kq_row_avx2(const uint8_t* row, uint32_t nb, const BlockQ8xK* const* x, float* res) {
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    constexpr int U = NT == 1 ? 4 : 2;  // accumulators per token (FMA latency)
    __m256 acc[NT][U], cacc[NT];
    for (int j = 0; j < NT; ++j) {
        cacc[j] = _mm256_setzero_ps();
        for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + (size_t)b * BB;
        __m256i wq[8];  // sub-block s in natural order
        if (FMT == FT_FMT_Q6_K) {
            const float d = _cvtsh_ss(*(const uint16_t*)(blk + 208));
            const __m128i sc = _mm_loadu_si128((const __m128i*)(blk + 192));
            const __m256 G0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), _mm256_set1_ps(d));
            const __m256 G1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), _mm256_set1_ps(d));
            const __m256i m3 = _mm256_set1_epi8(0x03);
            for (int n = 0; n < 2; ++n) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
                const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
                wq[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
                wq[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
                wq[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
                wq[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
            }
            // per sub-block s: lanes 0-3 scale group 2s, lanes 4-7 group 2s+1
            __m256 wsc[8];
            for (int s = 0; s < 8; ++s) {
                const __m256 G = s < 4 ? G0 : G1;
                const int g = 2 * (s & 3);
                wsc[s] = _mm256_permutevar8x32_ps(G, _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1));
            }
            const __m256 off0 = _mm256_mul_ps(G0, _mm256_set1_ps(-32.0f)), off1 = _mm256_mul_ps(G1, _mm256_set1_ps(-32.0f));
            for (int j = 0; j < NT; ++j) {
                const BlockQ8xK& xb = x[j][b];
                for (int s = 0; s < 8; ++s) {
                    const __m256i p = dot4_u8i8(wq[s], _mm256_loadu_si256((const __m256i*)(xb.qs + 32 * s)));
                    const __m256 coef = _mm256_mul_ps(wsc[s], _mm256_broadcast_ss(xb.d + s));
                    acc[j][s % U] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), coef, acc[j][s % U]);
                }
                cacc[j] = _mm256_fmadd_ps(off0, _mm256_loadu_ps(xb.xs16), cacc[j]);
                cacc[j] = _mm256_fmadd_ps(off1, _mm256_loadu_ps(xb.xs16 + 8), cacc[j]);
            }
        } else {
            __m256 M;
            const __m256 S = kq2_scales_q45(blk, &M);
            const uint8_t* qs = blk + (FMT == FT_FMT_Q4_K ? 16 : 48);
            for (int c = 0; c < 4; ++c) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                wq[2 * c] = _mm256_and_si256(q, m4);
                wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            if (FMT == FT_FMT_Q5_K) {
                const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 16));
                const __m256i one = _mm256_set1_epi8(0x01);
                for (int s = 0; s < 8; ++s) {
                    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(s)), one);
                    wq[s] = _mm256_or_si256(wq[s], _mm256_slli_epi16(bit, 4));
                }
            }
            for (int j = 0; j < NT; ++j) {
                const BlockQ8xK& xb = x[j][b];
                const __m256 coef = _mm256_mul_ps(S, _mm256_loadu_ps(xb.d));
                for (int s = 0; s < 8; ++s) {
                    const __m256i p = dot4_u8i8(wq[s], _mm256_loadu_si256((const __m256i*)(xb.qs + 32 * s)));
                    const __m256 cs = _mm256_permutevar8x32_ps(coef, _mm256_set1_epi32(s));
                    acc[j][s % U] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), cs, acc[j][s % U]);
                }
                cacc[j] = _mm256_fnmadd_ps(M, _mm256_loadu_ps(xb.xs32), cacc[j]);
            }
        }
    }
    for (int j = 0; j < NT; ++j) {
        for (int u = 0; u < U; ++u) cacc[j] = _mm256_add_ps(cacc[j], acc[j][u]);
        res[j] = hsum256(cacc[j]);
    }
}

#ifndef FT_KQ_TILE_MIN_TOKENS
#define FT_KQ_TILE_MIN_TOKENS 2
#endif
// Tokens per call from which the tiles are faster than the row kernel.
constexpr uint32_t kKqTileMinTokens = FT_KQ_TILE_MIN_TOKENS;

template <int FMT>
static void dot_rows_kquant_avx2(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                 const void* const* xs, uint32_t ntok, float* out, size_t os) {
    if (ntok >= kKqTileMinTokens) {
        dot_rows_kquant_tiles<FMT>(w, e, r0, r1, xs, ntok, out, os);
        return;
    }
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    const BlockQ8xK* xv[2];
    for (uint32_t j0 = 0; j0 < ntok; j0 += 2) {
        const uint32_t nt = ntok - j0 < 2 ? ntok - j0 : 2;
        for (uint32_t j = 0; j < nt; ++j) xv[j] = (const BlockQ8xK*)xs[j0 + j];
        for (uint32_t r = r0; r < r1; ++r) {
            const uint8_t* row = base + (size_t)r * w.row_stride;
            float res[2];
            if (nt == 2) kq_row_avx2<FMT, 2>(row, nb, xv, res);
            else kq_row_avx2<FMT, 1>(row, nb, xv, res);
            for (uint32_t j = 0; j < nt; ++j) out[(j0 + j) * os + (r - r0)] = res[j];
        }
    }
}
