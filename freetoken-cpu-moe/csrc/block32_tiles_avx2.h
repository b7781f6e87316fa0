// Q8_0 and MXFP4 (blocks of 32 with one scale each, against ACT_Q8_32 activations) with
// many tokens per row on the AVX2 tiers (avx2, avx_vnni): rows in groups of 8, each block of
// the group unpacked once into a tile of int8 codes, against which every token of the call is
// multiplied. The layout is that of the K-quant tiles (kquant_tiles_avx2.h): q[j] is one
// 32-byte register for step j (elements 4 j .. 4 j + 3 of the block), dword lane r holds row
// r's 4 codes there, and a token's 4 activation codes broadcast to every lane meet it in one
// instruction that leaves each row's sums in its own lane.
//
// Exact int32 sums J = sum over the block of w x (the same on both tiers):
//   Q8_0, avx2: |w| against x with w's sign (vpsignb), vpmaddubsw + vpmaddwd per step (a pair
//     of products reaches 2 x 128 x 127: no int16 sums over several steps).
//   Q8_0, avx_vnni: (w + 128) against x with vpdpbusd, minus 128 x (the block's code sum).
//   MXFP4, both: (value + 12) in 0..24 from a vpshufb table, minus 12 x (code sum); avx2
//     adds vpmaddubsw's int16 pairs (at most 2 x 24 x 127) over the 4 steps of each half of
//     the block (4 x 6096 < 32768), then vpmaddwd.
// Float part, shared: total += float(J) x (the row's block scale x the token's block scale).
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

struct B32Tile {
    alignas(32) uint8_t q[8][32];  // [step][row r: 4 codes]: Q8_0 avx2 |w|, avx_vnni w + 128; MXFP4 value + 12
    alignas(32) int8_t sg[8][32];  // Q8_0 on avx2: w (its signs)
    alignas(32) float d[8];        // the rows' block scales
};

// The 16 doubled E2M1 values plus 12, in both 128-bit lanes.
static inline __m256i mxfp4_lut12() {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

// float 2^(e - 128) for E8M0 exponents e (int32 lanes; e < 2 -> 0, as mxfp4_scale)
static inline __m256 mxfp4_scales8(__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_max_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), _mm256_setzero_si256()), 23));
}

// The 8 rows' blocks (blk[r]) -> tile.
template <int FMT>
static inline void b32_tile_unpack(const uint8_t* const* blk, B32Tile& t) {
    if (FMT == FT_FMT_Q8_0) {
        __m256i v[8];
        load_rows_t(blk, 2, v);
        load_rows_t(blk, 18, v + 4);
        for (int j = 0; j < 8; ++j) {
#if defined(FT_HAVE_AVX_VNNI)
            _mm256_store_si256((__m256i*)t.q[j], _mm256_xor_si256(v[j], _mm256_set1_epi8((char)0x80)));
#else
            _mm256_store_si256((__m256i*)t.q[j], _mm256_sign_epi8(v[j], v[j]));
            _mm256_store_si256((__m256i*)t.sg[j], v[j]);
#endif
        }
        _mm256_store_ps(t.d, kq_rows_half(blk, 0));
        return;
    }
    const __m256i lut = mxfp4_lut12(), m4 = _mm256_set1_epi8(0x0F);
    __m256i v[4];
    load_rows_t(blk, 1, v);  // dword j: codes of elements 4 j.. (low nibbles) and 16 + 4 j.. (high)
    for (int j = 0; j < 4; ++j) {
        _mm256_store_si256((__m256i*)t.q[j], _mm256_shuffle_epi8(lut, _mm256_and_si256(v[j], m4)));
        _mm256_store_si256((__m256i*)t.q[4 + j], _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v[j], 4), m4)));
    }
    _mm256_store_ps(t.d, mxfp4_scales8(_mm256_setr_epi32(blk[0][0], blk[1][0], blk[2][0], blk[3][0], blk[4][0], blk[5][0],
                                                          blk[6][0], blk[7][0])));
}

// J of one token against a tile: w the 8 step registers (sg: their signs, Q8_0 on avx2), xq
// the token's 32 codes as two 16-byte broadcasts, bias = (128 or 12) x the block's code sum.
template <int FMT>
static inline __m256i b32_tile_sum(const __m256i* w, const __m256i* sg, const __m256i* xq, int32_t bias) {
    (void)sg;
    (void)bias;
#if defined(FT_HAVE_AVX_VNNI)
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const int sh = j == 0 ? 0x00 : (j == 1 ? 0x55 : (j == 2 ? 0xAA : 0xFF));
        a = _mm256_dpbusd_avx_epi32(a, w[j], _mm256_shuffle_epi32(xq[0], sh));
        b = _mm256_dpbusd_avx_epi32(b, w[4 + j], _mm256_shuffle_epi32(xq[1], sh));
    }
    return _mm256_sub_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(bias));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (FMT == FT_FMT_Q8_0) {
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const int sh = (j & 3) == 0 ? 0x00 : ((j & 3) == 1 ? 0x55 : ((j & 3) == 2 ? 0xAA : 0xFF));
            const __m256i xs = _mm256_sign_epi8(_mm256_shuffle_epi32(xq[j / 4], sh), sg[j]);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xs), ones);
            if (j & 1) b = _mm256_add_epi32(b, p);
            else a = _mm256_add_epi32(a, p);
        }
        return _mm256_add_epi32(a, b);
    }
    __m256i h[2];
    for (int k = 0; k < 2; ++k)
        h[k] = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w[4 * k], _mm256_shuffle_epi32(xq[k], 0x00)),
                                                 _mm256_maddubs_epi16(w[4 * k + 1], _mm256_shuffle_epi32(xq[k], 0x55))),
                                _mm256_add_epi16(_mm256_maddubs_epi16(w[4 * k + 2], _mm256_shuffle_epi32(xq[k], 0xAA)),
                                                 _mm256_maddubs_epi16(w[4 * k + 3], _mm256_shuffle_epi32(xq[k], 0xFF))));
    return _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(h[0], ones), _mm256_madd_epi16(h[1], ones)),
                            _mm256_set1_epi32(bias));
#endif
}

// Whether the format's tile sums need the blocks' code sums (see the top of the file).
template <int FMT>
static constexpr bool b32_needs_sums() {
#if defined(FT_HAVE_AVX_VNNI)
    return true;
#else
    return FMT == FT_FMT_MXFP4;
#endif
}

// NT tokens against the 8 rows of nb tiles; bias[j][b] = the bias of token j's block b.
template <int FMT, int NT>
static inline void b32_tiles_dot(const B32Tile* tiles, uint32_t nb, const ActQ8x32View* x, const int32_t* const* bias,
                                 __m256* tot) {
    for (int j = 0; j < NT; ++j) tot[j] = _mm256_setzero_ps();
    for (uint32_t b = 0; b < nb; ++b) {
        const B32Tile& t = tiles[b];
        __m256i w[8], sg[8];
        for (int k = 0; k < 8; ++k) w[k] = _mm256_load_si256((const __m256i*)t.q[k]);
        if (FMT == FT_FMT_Q8_0 && !b32_needs_sums<FMT>())
            for (int k = 0; k < 8; ++k) sg[k] = _mm256_load_si256((const __m256i*)t.sg[k]);
        const __m256 d = _mm256_load_ps(t.d);
        for (int j = 0; j < NT; ++j) {
            const int8_t* xb = x[j].qs + (size_t)b * 32;
            const __m256i xq[2] = {_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xb)),
                                   _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + 16)))};
            const __m256i J = b32_tile_sum<FMT>(w, sg, xq, b32_needs_sums<FMT>() ? bias[j][b] : 0);
            tot[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(J), _mm256_mul_ps(d, _mm256_broadcast_ss(x[j].d + b)), tot[j]);
        }
    }
}

// bias[b] = k x (sum of the 32 codes of block b), b < nb
static inline void b32_code_sums(const int8_t* qs, uint32_t nb, int32_t k, int32_t* bias) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (uint32_t b = 0; b < nb; ++b) {
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i*)(qs + 32 * b))), ones16);
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        bias[b] = k * _mm_cvtsi128_si32(h);
    }
}

// Tokens per pass over a row group's tiles (their activations stay in L2).
constexpr uint32_t kB32TileTokens = 64;

template <int FMT>
static void dot_rows_b32_tiles(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1, const void* const* xs,
                               uint32_t ntok, float* out, size_t os) {
    constexpr size_t BB = FMT == FT_FMT_Q8_0 ? Q8_0_BYTES : MXFP4_BYTES;
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / 32;
    thread_local std::vector<B32Tile> tiles;
    thread_local std::vector<int32_t> sums;
    if (tiles.size() < nb) tiles.resize(nb);
    const size_t per = ((size_t)nb + 7) & ~(size_t)7;
    if (b32_needs_sums<FMT>() && sums.size() < (size_t)std::min(ntok, kB32TileTokens) * per)
        sums.resize((size_t)std::min(ntok, kB32TileTokens) * per);
    ActQ8x32View xv[4];
    const int32_t* bias[4];
    for (uint32_t t0 = 0; t0 < ntok; t0 += kB32TileTokens) {
        const uint32_t t1 = std::min(ntok, t0 + kB32TileTokens);
        if (b32_needs_sums<FMT>())
            for (uint32_t j = t0; j < t1; ++j)
                b32_code_sums(q8x32_view(xs[j], w.cols).qs, nb, FMT == FT_FMT_Q8_0 ? 128 : 12, sums.data() + (j - t0) * per);
        for (uint32_t g = r0; g < r1; g += 8) {
            const uint32_t n = std::min(8u, r1 - g);
            unpack_row_group8<BB>(base, w.row_stride, g, r1, nb,
                                  [&](const uint8_t* const* blk, uint32_t b) { b32_tile_unpack<FMT>(blk, tiles[b]); });
            for (uint32_t j0 = t0; j0 < t1; j0 += 4) {
                const uint32_t nt = std::min(4u, t1 - j0);
                for (uint32_t j = 0; j < nt; ++j) {
                    xv[j] = q8x32_view(xs[j0 + j], w.cols);
                    bias[j] = b32_needs_sums<FMT>() ? sums.data() + (j0 + j - t0) * per : nullptr;
                }
                __m256 v[4];
                switch (nt) {
                    case 4: b32_tiles_dot<FMT, 4>(tiles.data(), nb, xv, bias, v); break;
                    case 3: b32_tiles_dot<FMT, 3>(tiles.data(), nb, xv, bias, v); break;
                    case 2: b32_tiles_dot<FMT, 2>(tiles.data(), nb, xv, bias, v); break;
                    default: b32_tiles_dot<FMT, 1>(tiles.data(), nb, xv, bias, v); break;
                }
                for (uint32_t j = 0; j < nt; ++j) {
                    store_row_group8(out + (size_t)(j0 + j) * os + (g - r0), v[j], n);
                }
            }
        }
    }
}
