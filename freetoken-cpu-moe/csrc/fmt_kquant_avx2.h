// The K-quants on the AVX2 tiers (avx2, avx_vnni). Calls with several tokens take the tiles
// of kquant_tiles_avx2.h; one token takes the row kernel here.
//
// Row kernel: the activation has one scale per super-block on these tiers (act_prepare.h),
// so a whole block is summed in integers and converted to float once:
//   Q4_K/Q5_K: d x dx x sum_s(sc[s] x dot_s) - dmin x dx x sum_s(m[s] x bsum32_s)
//   Q6_K:      d x dx x (sum_s(sc[g] x dot_g) - 32 x sum_g(sc[g] x bsum_g))
// per block the codes are unpacked into eight registers, one per sub-block of 32 in natural
// order (so the token's activation codes are read as they are); vpmaddubsw multiplies them
// with the token's codes into int16 pair sums (exact: codes below 64, |activation| <= 127),
// and vpmaddwd (avx2, then vpaddd) or vpdpwssd (avx_vnni, accumulating) multiplies those by
// the sub-block's scale, an int16 broadcast over the register (Q6_K: the scale of elements
// 0-15 in the low 128-bit lane, of 16-31 in the high one), into 8 int32 sums of the block.
// The mins (Q4_K/Q5_K) are one vpmaddwd of the 8 mins with the token's 8 code sums per 32,
// the -32 offset of Q6_K one vpmaddwd of the 16 scales with the 16 code sums per 16. Both
// tiers form the same exact int32 sums and the same float operations after them, so their
// results are equal bit for bit.
// The weight stream is prefetched 2 KB ahead, across row ends (as on the AVX-512 tier).
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

// Q4_K/Q5_K header -> the 8 scales as int16 pairs (sc, sc), one dword each (sp[s]), and
// the 8 mins as int16 (returned). The 6-bit fields are unpacked in general-purpose
// registers (the vector units are this kernel's bottleneck): sc[j] = b[j] & 63, m[j] =
// b[j + 4] & 63 (j < 4); sc[j] = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4, m[j] = (b[j + 4] >>
// 4) | (b[j] >> 6) << 4 (j >= 4), b = bytes 4..15; each scale is then spread into a dword
// (pdep) and doubled into both int16 halves, so the kernel broadcasts it from memory (a
// load, no shuffle).
static inline __m128i kq45_scales_mins(const uint8_t* blk, uint32_t* sp) {
    uint32_t u[3];
    std::memcpy(u, blk + 4, 12);
    const uint32_t k3F = 0x3f3f3f3fu, k0F = 0x0f0f0f0fu, k03 = 0x03030303u;
    const uint32_t sc_lo = u[0] & k3F, m_lo = u[1] & k3F;
    const uint32_t sc_hi = (u[2] & k0F) | (((u[0] >> 6) & k03) << 4);
    const uint32_t m_hi = ((u[2] >> 4) & k0F) | (((u[1] >> 6) & k03) << 4);
    const uint64_t dw = 0x000000FF000000FFull;  // two bytes into the low bytes of two dwords
    const uint64_t p0 = _pdep_u64(sc_lo, dw), p1 = _pdep_u64(sc_lo >> 16, dw);
    const uint64_t p2 = _pdep_u64(sc_hi, dw), p3 = _pdep_u64(sc_hi >> 16, dw);
    const uint64_t q[4] = {p0 | (p0 << 16), p1 | (p1 << 16), p2 | (p2 << 16), p3 | (p3 << 16)};
    std::memcpy(sp, q, 32);
    return _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)((uint64_t)m_lo | ((uint64_t)m_hi << 32))));
}

// vpshufb controls that broadcast int16 word 2 s' of the low 128-bit lane and 2 s' + 1 of the
// high one (Q6_K's two scales of sub-block s, s' = s % 4).
struct KqWordCtl {
    uint8_t c6[4][32];
};
static constexpr KqWordCtl make_kq_word_ctl() {
    KqWordCtl t{};
    for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 32; ++i) t.c6[s][i] = (uint8_t)(2 * (2 * s + i / 16) + (i & 1));
    return t;
}
alignas(32) static constexpr KqWordCtl kKqWordCtl = make_kq_word_ctl();

// acc + p (int16 pairs) x sc (int16 pairs), into int32
static inline __m256i kq_madd_acc(__m256i acc, __m256i p, __m256i sc) {
#if defined(FT_HAVE_AVX_VNNI)
    return _mm256_dpwssd_avx_epi32(acc, p, sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
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
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + (size_t)b * BB;
        for (size_t o = 0; o < BB; o += 64) _mm_prefetch((const char*)blk + kKqPrefetch + o, _MM_HINT_T0);
        const BlockQ8xK& xb = x[b];
        __m256i wq[8];
        kq_row_codes<FMT>(blk, wq);
        // the block's int32 sums: on avx_vnni two (even / odd sub-blocks), as each vpdpwssd
        // waits for the last; on avx2 one (vpmaddwd, then vpaddd)
#if defined(FT_HAVE_AVX_VNNI)
        constexpr int NS = 2;
#else
        constexpr int NS = 1;
#endif
        __m256i si[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (FMT == FT_FMT_Q6_K) {
            // int16 [sc0..sc7 | sc8..sc15]; both lanes [sc0..sc7] / [sc8..sc15]
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
            const __m256i lo = _mm256_permute4x64_epi64(sc, 0x44), hi = _mm256_permute4x64_epi64(sc, 0xEE);
            for (int s = 0; s < 8; ++s) {
                const __m256i p = _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i*)(xb.qs + 32 * s)));
                const __m256i scs = _mm256_shuffle_epi8(s < 4 ? lo : hi, _mm256_load_si256((const __m256i*)kKqWordCtl.c6[s % 4]));
                si[s % NS] = kq_madd_acc(si[s % NS], p, scs);
            }
            // the -32 offset: 32 x sum_g sc[g] x bsum_g
            const __m256i off = _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i*)xb.bsums));
            const __m256i sumi = _mm256_sub_epi32(NS == 2 ? _mm256_add_epi32(si[0], si[1]) : si[0], _mm256_slli_epi32(off, 5));
            uint16_t dh;
            std::memcpy(&dh, blk + 208, 2);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(_cvtsh_ss(dh) * xb.d[0]), acc);
        } else {
            alignas(32) uint32_t sp[8];
            const __m128i mins = kq45_scales_mins(blk, sp);
            for (int s = 0; s < 8; ++s) {
                const __m256i p = _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i*)(xb.qs + 32 * s)));
                si[s % NS] = kq_madd_acc(si[s % NS], p, _mm256_castps_si256(_mm256_broadcast_ss((const float*)(sp + s))));
            }
            const __m128i mp = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)xb.bsums32));
            uint32_t dm;
            std::memcpy(&dm, blk, 4);
            const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)), _mm_set1_ps(xb.d[0]));  // [d dx, dmin dx]
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(NS == 2 ? _mm256_add_epi32(si[0], si[1]) : si[0]), _mm256_broadcastss_ps(dd), acc);
            accm = _mm_fmadd_ps(_mm_cvtepi32_ps(mp), _mm_permute_ps(dd, 0x55), accm);
        }
    }
    // Q4_K/Q5_K: minus the mins
    return FMT == FT_FMT_Q6_K ? acc : _mm256_sub_ps(acc, _mm256_set_m128(_mm_setzero_ps(), accm));
}

// Tokens per call from which the tiles are faster than the row kernel (from two: one thread,
// weights in L2, q4_k T=2 42 GB/s x tokens against the row kernel's 28 for each token when
// this was set; the row kernel with one activation scale per super-block does 36-38).
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
