// AVX-512 VNNI kernels for the K-quants. Per 256-element block the weights are
// unpacked once into four registers of 64 unsigned codes and their scales into one
// float vector; then every token's int8 block (laid out in the same register order
// by prepare_q8_k) is multiplied with vpdpbusd.
//
// Q4_K/Q5_K: the dword lanes of registers A and B (see kq45_act_index) map to the
// same sub-blocks, so their products add up in one int32 register: two registers of
// sums per block instead of four, each converted once and scaled per lane by
// (d x sc x activation scale), spread over the lanes by one vpermps. The high nibbles
// stay in place (Q4_K: 16 x code) or move by one bit (Q5_K: 8 x code); the activation
// scales of the odd sub-blocks carry the inverse power of two. The 6-bit scales and
// mins are unpacked in vector registers from the block header broadcast to every
// 128-bit lane, into [sc0, m0, sc1, m1, ...]; one multiply by [d, dmin, ...] and one
// by the token's [scale, -sum] pairs give the lane coefficients (even lanes) and the
// min terms (odd lanes, accumulated as they are).
// Q6_K: natural order, 16 scales per block, elements 96-127 of each 128 held as
// 4 x code (no shift of their high bits); the -32 offset is applied once per row
// from the token's sums per group of 16.
// Scalar code and moves between general and vector registers are avoided in the
// block loop: both cost more here than the vector instructions they replace.
#pragma once

struct KqLaneIdx {
    __m512i q45[2], q6[4];
    KqLaneIdx() {
        alignas(64) int32_t t[16];
        for (int h = 0; h < 2; ++h) {
            // lane l of the sums of half h: sub-block 4h + 2 (l / 8) + (l & 1), at 2 x that in the
            // interleaved [coefficient, min] vector
            for (int l = 0; l < 16; ++l) t[l] = 2 * (4 * h + 2 * (l / 8) + (l & 1));
            q45[h] = _mm512_load_si512(t);
        }
        for (int r = 0; r < 4; ++r) {
            for (int l = 0; l < 16; ++l) t[l] = 4 * r + l / 4;
            q6[r] = _mm512_load_si512(t);
        }
    }
};

// Per dword lane l of the unpacked scales (s = l / 2; even l: sc[s], odd l: m[s]):
// which header bytes vpshufb brings into bytes 0 and 1, the right shift of byte 0 and
// the mask of its bits. sc[s], m[s] for s < 4 are the low 6 bits of bytes 4 + s and
// 8 + s; for s >= 4 the low / high nibble of byte 8 + s, topped by bits 6-7 of byte
// s / 4 + s at bits 4-5.
struct Kq45ScaleCtl {
    __m512i sel, shift, mask;
    Kq45ScaleCtl() {
        alignas(64) int32_t c[16], sh[16], mk[16];
        for (int l = 0; l < 16; ++l) {
            const int s = l / 2, is_min = l & 1;
            // byte 0 of the dword: the low bits' byte; byte 1: the byte with the top 2 bits (s >= 4)
            const int lo = 4 + s + 4 * is_min + (s >= 4 && !is_min ? 4 : 0);
            const int hi = s >= 4 ? (is_min ? 4 + s : s) : -1;
            c[l] = lo | ((hi < 0 ? 0x80 : hi) << 8) | (0x80 << 16) | (0x80 << 24);
            sh[l] = s >= 4 && is_min ? 4 : 0;
            mk[l] = s >= 4 ? 0x0F : 0x3F;
        }
        sel = _mm512_load_si512(c);
        shift = _mm512_load_si512(sh);
        mask = _mm512_load_si512(mk);
    }
};

// Q4_K/Q5_K block header -> 16 floats [d sc0, dmin m0, d sc1, dmin m1, ...].
static inline __m512 kq45_scales(const uint8_t* blk, const Kq45ScaleCtl& k) {
    const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)blk));
    const __m512i c = _mm512_shuffle_epi8(h, k.sel);
    // bits selected by the mask from the low byte, the rest (the top 2 bits at 4-5) from the high byte
    const __m512i v = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(c, k.shift), _mm512_srli_epi32(c, 10), k.mask, 0xE4);
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(dd))));
}

// Q4_K/Q5_K block -> registers A0, B0, A1, B1 (codes as documented above).
template <int FMT>
static inline void kq45_weights(const uint8_t* blk, __m512i* w) {
    if (FMT == FT_FMT_Q4_K) {
        const __m512i mk = _mm512_set1_epi64((long long)0xF0F0F0F00F0F0F0Full);  // even dwords 0x0F, odd 0xF0
        const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
        w[0] = _mm512_and_si512(q0, mk);
        w[1] = _mm512_and_si512(_mm512_shuffle_epi32(q0, _MM_PERM_CDAB), mk);
        w[2] = _mm512_and_si512(q1, mk);
        w[3] = _mm512_and_si512(_mm512_shuffle_epi32(q1, _MM_PERM_CDAB), mk);
    } else {
        // even dwords: (q & 0x0F) | hbit << 4; odd dwords: (q & 0xF0) >> 1 | hbit << 7.
        // The high bit of a byte of chunk c is bit 2c (low nibble) or 2c + 1 (high) of
        // qh[j], brought to bit 4 / 7 by rotating each dword.
        const __m512i sq = _mm512_set1_epi64((long long)0x0000000100000000ull);
        const __m512i mq = _mm512_set1_epi64((long long)0x787878780F0F0F0Full);
        const __m512i mh = _mm512_set1_epi64((long long)0x8080808010101010ull);
        const __m512i r0 = _mm512_setr_epi32(4, 6, 4, 6, 4, 6, 4, 6, 2, 4, 2, 4, 2, 4, 2, 4);
        const __m512i r1 = _mm512_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2, 30, 0, 30, 0, 30, 0, 30, 0);
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16)));
        const __m512i hs = _mm512_shuffle_epi32(h, _MM_PERM_CDAB);
        const __m512i q0 = _mm512_loadu_si512(blk + 48), q1 = _mm512_loadu_si512(blk + 112);
        const __m512i q[4] = {q0, _mm512_shuffle_epi32(q0, _MM_PERM_CDAB), q1, _mm512_shuffle_epi32(q1, _MM_PERM_CDAB)};
        for (int r = 0; r < 4; ++r) {
            const __m512i hb = _mm512_and_si512(_mm512_rolv_epi32(r & 1 ? hs : h, r < 2 ? r0 : r1), mh);
            w[r] = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(q[r], sq), hb, mq, 0xEC);  // (a & c) | b
        }
    }
}

// Q6_K block -> four registers of codes in natural order (see above), and d x sc[16].
static inline __m512 kq6_weights(const uint8_t* blk, __m512i* w) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    constexpr long long k0F = 0x0F0F0F0F0F0F0F0Fll, k30 = 0x3030303030303030ll, k3C = 0x3C3C3C3C3C3C3C3Cll,
                        kC0 = (long long)0xC0C0C0C0C0C0C0C0ull;
    for (int n = 0; n < 2; ++n) {
        const __m512i l = _mm512_loadu_si512(blk + 64 * n);
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n)));
        // low nibbles: qh bits 0-1 (bytes 0-31) / 2-3 (bytes 32-63) moved to bits 4-5
        const __m512i hl = _mm512_and_si512(_mm512_sllv_epi64(h, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4)), m30);
        w[2 * n] = _mm512_ternarylogic_epi32(l, hl, m4, 0xEC);
        // high nibbles: code (bytes 0-31: nibble at 0-3, qh bits 4-5 in place) or 4 x code
        // (bytes 32-63: nibble at 2-5, qh bits 6-7 in place)
        const __m512i hh = _mm512_and_si512(h, _mm512_set_epi64(kC0, kC0, kC0, kC0, k30, k30, k30, k30));
        w[2 * n + 1] = _mm512_ternarylogic_epi32(_mm512_srlv_epi64(l, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4)), hh,
                                                 _mm512_set_epi64(k3C, k3C, k3C, k3C, k0F, k0F, k0F, k0F), 0xEC);
    }
    // d (the last 2 bytes of the block) as the second half of the dword before it
    uint32_t dw;
    std::memcpy(&dw, blk + 206, 4);
    const __m128 dv = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dw));
    const __m512 d = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dv));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)))), d);
}

// Software prefetch distance of the weight stream, in bytes. Rows of one matrix are
// contiguous, so the prefetches run ahead over row ends; with the hardware prefetchers
// alone a core computing between its loads keeps too few lines in flight (one thread
// streamed Q5_K at 11 GB/s without, 16 with; 2 KB and 3 KB measured alike, 4 KB and
// 768 B a little slower).
constexpr int kKqPrefetch = 2048;

static inline void kq_prefetch_block(const uint8_t* blk, size_t bytes) {
    for (size_t c = 0; c < bytes; c += 64) _mm_prefetch((const char*)blk + kKqPrefetch + c, _MM_HINT_T0);
}

// One row against NT tokens; vres[j] holds token j's dot product spread over 16 lanes.
template <int FMT, int NT>
static inline void kq_row_avx512(const uint8_t* row, uint32_t nb, const BlockQ8xK* const* x, const KqLaneIdx& ix,
                                 const Kq45ScaleCtl& kc, __m512* vres) {
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    if (FMT == FT_FMT_Q6_K) {
        constexpr int U = NT == 1 ? 4 : (NT == 2 ? 2 : 1);  // accumulators per token (FMA latency)
        __m512 acc[NT][U];
        for (int j = 0; j < NT; ++j)
            for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
        __m512 cacc[NT];
        for (int j = 0; j < NT; ++j) cacc[j] = _mm512_setzero_ps();
        for (uint32_t b = 0; b < nb; ++b) {
            __m512i wq[4];
            kq_prefetch_block(row + (size_t)b * BB, BB);
            const __m512 G = kq6_weights(row + (size_t)b * BB, wq);
            for (int j = 0; j < NT; ++j) {
                const BlockQ8xK& xb = x[j][b];
                const __m512 P = _mm512_mul_ps(G, _mm512_loadu_ps(xb.dx16));
                for (int r = 0; r < 4; ++r) {
                    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[r], _mm512_loadu_si512(xb.qs + 64 * r));
                    acc[j][r % U] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(ix.q6[r], P), acc[j][r % U]);
                }
                cacc[j] = _mm512_fmadd_ps(G, _mm512_loadu_ps(xb.xs16), cacc[j]);
            }
        }
        for (int j = 0; j < NT; ++j) acc[j][0] = _mm512_fmadd_ps(cacc[j], _mm512_set1_ps(-32.0f), acc[j][0]);  // -32 offset
        for (int j = 0; j < NT; ++j) {
            for (int u = 1; u < U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
            vres[j] = acc[j][0];
        }
    } else {
        __m512 acc0[NT], acc1[NT], cacc[NT];
        for (int j = 0; j < NT; ++j) acc0[j] = acc1[j] = cacc[j] = _mm512_setzero_ps();
        for (uint32_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + (size_t)b * BB;
            kq_prefetch_block(blk, BB);
            __m512i w[4];
            kq45_weights<FMT>(blk, w);
            const __m512 sm = kq45_scales(blk, kc);
            for (int j = 0; j < NT; ++j) {
                const BlockQ8xK& xb = x[j][b];
                const __m512 P = _mm512_mul_ps(sm, _mm512_loadu_ps(FMT == FT_FMT_Q4_K ? xb.xdm4 : xb.xdm5));
                const __m512i s01 = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(xb.qs4k)), w[1],
                    _mm512_loadu_si512(xb.qs4k + 64));
                const __m512i s23 = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], _mm512_loadu_si512(xb.qs4k + 128)), w[3],
                    _mm512_loadu_si512(xb.qs4k + 192));
                acc0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s01), _mm512_permutexvar_ps(ix.q45[0], P), acc0[j]);
                acc1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s23), _mm512_permutexvar_ps(ix.q45[1], P), acc1[j]);
                cacc[j] = _mm512_mask_add_ps(cacc[j], (__mmask16)0xAAAA, cacc[j], P);  // min terms
            }
        }
        for (int j = 0; j < NT; ++j) vres[j] = _mm512_add_ps(_mm512_add_ps(acc0[j], acc1[j]), cacc[j]);
    }
}

template <int FMT>
static void dot_rows_kquant_avx512(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                   const void* const* xs, uint32_t ntok, float* out, size_t os) {
    static const KqLaneIdx ix;
    static const Kq45ScaleCtl kc;
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    const BlockQ8xK* xv[4];
    if (ntok == 1) {  // rows in groups of 16, summed together
        xv[0] = (const BlockQ8xK*)xs[0];
        __m512 v[16];
        for (uint32_t g = r0; g < r1; g += 16) {
            const uint32_t n = r1 - g < 16 ? r1 - g : 16;
            for (uint32_t i = 0; i < n; ++i)
                kq_row_avx512<FMT, 1>(base + (size_t)(g + i) * w.row_stride, nb, xv, ix, kc, &v[i]);
            hsum16_avx512(v, (int)n, out + (g - r0));
        }
        return;
    }
    // Many tokens: tiles of kTileRows rows x kTileBlocks super-blocks (a few dozen KiB of
    // weights, kept in L2) run against every group of 4 tokens before the next tile, so
    // the weights stream from memory once per call and each group's activations for the
    // tile (4 x kTileBlocks Q8_K blocks) stay in L1; a row's dot product is the sum of its
    // tiles' partial sums.
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    constexpr uint32_t kTileRows = 16, kTileBlocks = 16;
    for (uint32_t rt = r0; rt < r1; rt += kTileRows) {
        const uint32_t re = r1 - rt < kTileRows ? r1 : rt + kTileRows;
        for (uint32_t b0 = 0; b0 < nb; b0 += kTileBlocks) {
            const uint32_t nbt = nb - b0 < kTileBlocks ? nb - b0 : kTileBlocks;
            for (uint32_t j0 = 0; j0 < ntok; j0 += 4) {
                const uint32_t nt = ntok - j0 < 4 ? ntok - j0 : 4;
                for (uint32_t j = 0; j < nt; ++j) xv[j] = (const BlockQ8xK*)xs[j0 + j] + b0;
                for (uint32_t r = rt; r < re; ++r) {
                    const uint8_t* row = base + (size_t)r * w.row_stride + (size_t)b0 * BB;
                    __m512 v[4];
                    switch (nt) {
                        case 4: kq_row_avx512<FMT, 4>(row, nbt, xv, ix, kc, v); break;
                        case 3: kq_row_avx512<FMT, 3>(row, nbt, xv, ix, kc, v); break;
                        case 2: kq_row_avx512<FMT, 2>(row, nbt, xv, ix, kc, v); break;
                        default: kq_row_avx512<FMT, 1>(row, nbt, xv, ix, kc, v); break;
                    }
                    for (uint32_t j = 0; j < nt; ++j) {
                        float& o = out[(j0 + j) * os + (r - r0)];
                        const float part = _mm512_reduce_add_ps(v[j]);
                        o = b0 == 0 ? part : o + part;
                    }
                }
            }
        }
    }
}
