// The K-quants on the AVX2 tiers (avx2, avx_vnni). Calls with several tokens take the tiles
// of kquant_tiles_avx2.h; one token takes the row kernel here.
//
// Row kernel: per 256-element block the codes are unpacked into eight registers, one per
// sub-block of 32 in natural order (so the token's activation codes are read as they are),
// and each meets the token's codes in dot4_u8i8 (dot_i8_avx2.h: vpmaddubsw + vpmaddwd, or
// vpdpbusd on avx_vnni; codes below 64, so both tiers sum exactly alike), which leaves 8
// int32 partial sums per sub-block. Four sub-blocks' partial sums are added into one
// register with unpacks (sum4_epi32, reduce_avx2.h): dword i of 128-bit lane h = sub-block
// i's sum over its elements 16 h .. 16 h + 15. So one conversion and one FMA serve four sub-blocks; the lane
// coefficients are the block's scales in that order times the token's activation scales,
// which are the same in both 128-bit lanes (a 16-byte broadcast). For Q6_K the 128-bit
// lanes are exactly its scale groups of 16 (lane h of sub-block i: group 2 i + h), so its
// scales are permuted into [g0 g2 g4 g6 | g1 g3 g5 g7] (and [g8 ... | g9 ...]) while the
// activation scales (one per 32 = per pair of groups) keep the same broadcast.
// Q4_K/Q5_K: the mins term -dmin x m x (activation scale x code sum) per sub-block is one
// FMA per block over the 8 sub-blocks; Q6_K: the -32 offset is -32 x d x sc x (activation
// scale x code sum) per group, two FMAs per block.
// The weight stream is prefetched 2 KB ahead, across row ends (as on the AVX-512 tier).
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

// Q4_K/Q5_K header -> S = d x sc[s], M = dmin x m[s] (lane s). The 6-bit fields are
// unpacked in general-purpose registers (four 32-bit words: sc[0..7], then m[0..7]), which
// leaves the vector units, this kernel's bottleneck, to the dot products.
static inline void kq45_row_scales(const uint8_t* blk, __m256* S, __m256* M) {
    uint32_t u[3];
    std::memcpy(u, blk + 4, 12);
    const uint32_t k3F = 0x3f3f3f3fu, k0F = 0x0f0f0f0fu, k03 = 0x03030303u;
    const uint32_t sc_lo = u[0] & k3F, m_lo = u[1] & k3F;
    const uint32_t sc_hi = (u[2] & k0F) | (((u[0] >> 6) & k03) << 4);
    const uint32_t m_hi = ((u[2] >> 4) & k0F) | (((u[1] >> 6) & k03) << 4);
    const __m128i v = _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi);
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));  // [d, dmin, 0, 0]
    *S = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_broadcastss_ps(dd));
    *M = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_broadcastss_ps(_mm_movehdup_ps(dd)));
}

// Block -> the 8 sub-blocks' codes in natural order.
template <int FMT>
static inline void kq_row_codes(const uint8_t* blk, __m256i* wq) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (FMT == FT_FMT_Q6_K) {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int n = 0; n < 2; ++n) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
            // code = low nibble | 2 high bits at 4-5 (qh bits 0-1, 2-3, 4-5, 6-7 for the four 32s)
            wq[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            wq[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            wq[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
            wq[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
        }
        return;
    }
    const uint8_t* qs = blk + (FMT == FT_FMT_Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        wq[2 * c] = _mm256_and_si256(q, m4);
        wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    if (FMT == FT_FMT_Q5_K) {
        // the fifth bit of sub-block s is bit s of qh[j], moved to bit 4
        const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 16));
        const __m256i m10 = _mm256_set1_epi8(0x10);
        wq[0] = _mm256_or_si256(wq[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), m10));
        wq[1] = _mm256_or_si256(wq[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), m10));
        wq[2] = _mm256_or_si256(wq[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), m10));
        wq[3] = _mm256_or_si256(wq[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), m10));
        wq[4] = _mm256_or_si256(wq[4], _mm256_and_si256(h, m10));
        wq[5] = _mm256_or_si256(wq[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), m10));
        wq[6] = _mm256_or_si256(wq[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), m10));
        wq[7] = _mm256_or_si256(wq[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), m10));
    }
}

// Software prefetch distance of the weight stream, in bytes (as the AVX-512 kernels').
constexpr int kKqPrefetch = 2048;

// One row against one token; the dot product spread over the lanes of the result.
template <int FMT>
static inline __m256 kq_row_avx2(const uint8_t* row, uint32_t nb, const BlockQ8xK* x) {
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), cacc = _mm256_setzero_ps();
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + (size_t)b * BB;
        for (size_t o = 0; o < BB; o += 64) _mm_prefetch((const char*)blk + kKqPrefetch + o, _MM_HINT_T0);
        __m256i wq[8];
        kq_row_codes<FMT>(blk, wq);
        const BlockQ8xK& xb = x[b];
        __m256i p[8];
        for (int s = 0; s < 8; ++s) p[s] = dot4_u8i8(wq[s], _mm256_loadu_si256((const __m256i*)(xb.qs + 32 * s)));
        const __m256i s0 = sum4_epi32(p[0], p[1], p[2], p[3]), s1 = sum4_epi32(p[4], p[5], p[6], p[7]);
        __m256 c0, c1;  // lane coefficients of s0, s1
        if (FMT == FT_FMT_Q6_K) {
            // d x sc[g] for the groups in the order of s0 / s1, and in natural order for the offset
            uint16_t dh;
            std::memcpy(&dh, blk + 208, 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
            const __m128i sc = _mm_loadu_si128((const __m128i*)(blk + 192));
            const __m128i scp = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
            const __m256 G0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scp)), d);
            const __m256 G1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scp, 8))), d);
            c0 = _mm256_mul_ps(G0, _mm256_broadcast_ps((const __m128*)xb.d));
            c1 = _mm256_mul_ps(G1, _mm256_broadcast_ps((const __m128*)(xb.d + 4)));
            const __m256 N0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
            const __m256 N1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
            cacc = _mm256_fmadd_ps(N0, _mm256_loadu_ps(xb.xs16), cacc);
            cacc = _mm256_fmadd_ps(N1, _mm256_loadu_ps(xb.xs16 + 8), cacc);
        } else {
            __m256 S, M;
            kq45_row_scales(blk, &S, &M);
            c0 = _mm256_mul_ps(_mm256_permute2f128_ps(S, S, 0x00), _mm256_broadcast_ps((const __m128*)xb.d));
            c1 = _mm256_mul_ps(_mm256_permute2f128_ps(S, S, 0x11), _mm256_broadcast_ps((const __m128*)(xb.d + 4)));
            cacc = _mm256_fmadd_ps(M, _mm256_loadu_ps(xb.xs32), cacc);
        }
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), c0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), c1, acc1);
    }
    const __m256 a = _mm256_add_ps(acc0, acc1);
    // Q4_K/Q5_K: minus the mins; Q6_K: the -32 offset
    return FMT == FT_FMT_Q6_K ? _mm256_fmadd_ps(cacc, _mm256_set1_ps(-32.0f), a) : _mm256_sub_ps(a, cacc);
}

// Tokens per call from which the tiles are faster than the row kernel (from two: one thread,
// weights in L2, q4_k T=2 42 GB/s x tokens against the row kernel's 28 for each token).
constexpr uint32_t kKqTileMinTokens = 2;

template <int FMT>
static void dot_rows_kquant_avx2(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                 const void* const* xs, uint32_t ntok, float* out, size_t os) {
    if (ntok >= kKqTileMinTokens) {
        dot_rows_kquant_tiles<FMT>(w, e, r0, r1, xs, ntok, out, os);
        return;
    }
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    for (uint32_t j = 0; j < ntok; ++j) {
        const BlockQ8xK* x = (const BlockQ8xK*)xs[j];
        float* o = out + (size_t)j * os;
        for (uint32_t g = r0; g < r1; g += 8) {  // rows in groups of 8, summed together
            const uint32_t n = std::min(8u, r1 - g);
            __m256 v[8];
            for (uint32_t i = 0; i < 8; ++i)
                v[i] = i < n ? kq_row_avx2<FMT>(base + (size_t)(g + i) * w.row_stride, nb, x) : _mm256_setzero_ps();
            const __m256 sums = hsum8_ps(v);
            if (n == 8) {
                _mm256_storeu_ps(o + (g - r0), sums);
            } else {
                alignas(32) float tmp[8];
                _mm256_store_ps(tmp, sums);
                for (uint32_t i = 0; i < n; ++i) o[g - r0 + i] = tmp[i];
            }
        }
    }
}
