// The K-quants' path for many tokens per row on the AVX2 tiers (avx2, avx_vnni): rows in
// groups of 8, each super-block of the group unpacked once into a tile of int8 codes,
// against which every token of the call is multiplied.
//
// Tile layout (KqTile, one super-block of 8 rows): q[s][j] is one 32-byte register for
// sub-block s (elements 32 s .. 32 s + 31) and step j (elements 32 s + 4 j .. + 3): dword
// lane r holds row r's 4 codes there. A token's 4 activation codes of the step, the same
// in every lane (vpshufd of the token's 16 bytes broadcast to both 128-bit lanes), meet the
// register in one vpmaddubsw (avx2) or vpdpbusd (avx_vnni), which leaves each row's sums in
// its own lane: one activation broadcast serves 8 rows and no sums across lanes are needed.
// The unpacking transposes the rows' 16-byte pieces (rows r and r + 4 in the two 128-bit
// lanes of one register, then a 4x4 dword transpose inside the lanes).
//
// Integer sums per scale group, exact and the same on both tiers:
//   avx2: vpmaddubsw gives int16 sums of two products; they are added in int16 over as many
//   steps as cannot overflow (8 products x 15 x 127 <= 32767 for Q4_K: a whole sub-block of
//   8 steps; Q5_K codes < 32: 4 steps; Q6_K codes < 64: 2 steps), then vpmaddwd with the
//   scale as an int16 pair (sc, sc) adds the two halves of each lane times the scale.
//   avx_vnni: vpdpbusd adds whole steps in int32; vpmulld applies the scale.
// So J = sum over the sub-block's scale groups of sc x (codes . activation codes), for Q6_K
// minus 32 x sc x (the group's activation code sum) through one vpmaddwd of the scales'
// pairs x (-32) with the token's two int16 group sums. The float part, the same code on both
// tiers (so their results are equal bit for bit):
//   total += d x (sum over the block's sub-blocks of float(J) x activation scale of the sub-block)
//   Q4_K/Q5_K: total += (-dmin x m) x (activation scale x code sum of the sub-block)
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

struct KqTile {
    alignas(32) uint8_t q[8][8][32];  // [sub-block][step][row r: 4 codes]
    // Q4_K/Q5_K: [s][r] the 6-bit scale of sub-block s; Q6_K: [g][r] the int8 scale of group g.
    // avx2: as the int16 pair (sc, sc); avx_vnni: as int32.
    alignas(32) int32_t sc[16][8];
    // Q4_K/Q5_K: [s][r] -dmin x m (float); Q6_K: [s][r] the int16 pair (-32 sc[2s], -32 sc[2s + 1])
    alignas(32) int32_t aux[8][8];
    alignas(32) float d[8];
};

// 4x4 transposes of dwords inside each 128-bit lane of v[0..3].
static inline void transpose4x4_epi32(__m256i* v) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

// v[k], lane r = dword k of the 16 bytes at p[r] + off (rows r = 0..7).
static inline void load_rows_t(const uint8_t* const* p, size_t off, __m256i* v) {
    for (int r = 0; r < 4; ++r)
        v[r] = _mm256_loadu2_m128i((const __m128i*)(p[r + 4] + off), (const __m128i*)(p[r] + off));
    transpose4x4_epi32(v);
}

// vpshufb controls, as constants: c[pair][b] moves byte b of every dword into byte 0 of it
// (and into byte 2 too with pair), zeros elsewhere.
struct KqByteCtl {
    uint8_t c[2][4][32];
};
static constexpr KqByteCtl make_kq_byte_ctl() {
    KqByteCtl t{};
    for (int pair = 0; pair < 2; ++pair)
        for (int b = 0; b < 4; ++b)
            for (int i = 0; i < 32; ++i) {
                const int k = i % 16 / 4, pos = i % 4;  // dword of the 128-bit lane, byte of the dword
                const bool take = pos == 0 || (pair && pos == 2);
                t.c[pair][b][i] = take ? (uint8_t)(4 * k + b) : (uint8_t)0x80;
            }
    return t;
}
alignas(32) static constexpr KqByteCtl kKqByteCtl = make_kq_byte_ctl();
static inline __m256i kq_byte_ctl(int b, bool pair) { return _mm256_load_si256((const __m256i*)kKqByteCtl.c[pair][b]); }

// fp16 words at byte offset off of the 8 blocks -> float.
static inline __m256 kq_rows_half(const uint8_t* const* blk, size_t off) {
    uint16_t h[8];
    for (int r = 0; r < 8; ++r) std::memcpy(&h[r], blk[r] + off, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
}

// The 8 rows' blocks (blk[r]) -> tile.
template <int FMT>
static inline void kq_tile_unpack(const uint8_t* const* blk, KqTile& t) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (FMT == FT_FMT_Q6_K) {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int n = 0; n < 2; ++n)
            for (int h = 0; h < 2; ++h) {
                __m256i l0[4], l1[4], qh[4];
                load_rows_t(blk, 64 * n + 16 * h, l0);
                load_rows_t(blk, 64 * n + 32 + 16 * h, l1);
                load_rows_t(blk, 128 + 32 * n + 16 * h, qh);
                for (int j = 0; j < 4; ++j) {
                    const int st = 4 * h + j;
                    const __m256i hh = qh[j];
                    _mm256_store_si256((__m256i*)t.q[4 * n + 0][st],
                                       _mm256_or_si256(_mm256_and_si256(l0[j], m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30)));
                    _mm256_store_si256((__m256i*)t.q[4 * n + 1][st],
                                       _mm256_or_si256(_mm256_and_si256(l1[j], m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30)));
                    _mm256_store_si256((__m256i*)t.q[4 * n + 2][st],
                                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0[j], 4), m4), _mm256_and_si256(hh, m30)));
                    _mm256_store_si256((__m256i*)t.q[4 * n + 3][st],
                                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1[j], 4), m4),
                                                       _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30)));
                }
            }
        // scales: E[k] byte i of lane r = sc[4k + i] of row r
        __m256i E[4];
        load_rows_t(blk, 192, E);
        for (int g = 0; g < 16; ++g) {
            const __m256i e = E[g / 4];
#if defined(FT_HAVE_AVX_VNNI)
            // byte into the top of the dword, arithmetic shift: sign-extended int32
            const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(_mm256_shuffle_epi8(e, kq_byte_ctl(g % 4, false)), 24), 24);
#else
            // byte into the top of both int16 halves, arithmetic shift: (sc, sc) as int16
            const __m256i v = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(e, kq_byte_ctl(g % 4, true)), 8), 8);
#endif
            _mm256_store_si256((__m256i*)t.sc[g], v);
        }
        for (int s = 0; s < 8; ++s) {
            // (sc[2s], sc[2s + 1]) as int16 in each dword, times -32
            const __m256i e = E[s / 2];
            const int b0 = (2 * s) % 4;
            const __m256i lo = _mm256_shuffle_epi8(e, kq_byte_ctl(b0, false));
            const __m256i hi = _mm256_shuffle_epi8(e, kq_byte_ctl(b0 + 1, false));
            const __m256i pr = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
            const __m256i sx = _mm256_srai_epi16(_mm256_slli_epi16(pr, 8), 8);
            _mm256_store_si256((__m256i*)t.aux[s], _mm256_mullo_epi16(sx, _mm256_set1_epi16(-32)));
        }
        _mm256_store_ps(t.d, kq_rows_half(blk, 208));
        return;
    }
    const size_t qoff = FMT == FT_FMT_Q4_K ? 16 : 48;
    __m256i qh[2][4];
    if (FMT == FT_FMT_Q5_K) {
        load_rows_t(blk, 16, qh[0]);
        load_rows_t(blk, 32, qh[1]);
    }
    for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) {
            __m256i v[4];
            load_rows_t(blk, qoff + 32 * c + 16 * h, v);
            for (int j = 0; j < 4; ++j) {
                __m256i lo = _mm256_and_si256(v[j], m4), hi = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), m4);
                if (FMT == FT_FMT_Q5_K) {
                    // the fifth bit of sub-block s is bit s of the qh byte; moved to bit 4
                    const __m256i m10 = _mm256_set1_epi8(0x10), q = qh[h][j];
                    const int s0 = 2 * c, s1 = 2 * c + 1;
                    const __m256i b0 = s0 <= 4 ? _mm256_slli_epi16(q, 4 - s0) : _mm256_srli_epi16(q, s0 - 4);
                    const __m256i b1 = s1 <= 4 ? _mm256_slli_epi16(q, 4 - s1) : _mm256_srli_epi16(q, s1 - 4);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(b0, m10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(b1, m10));
                }
                _mm256_store_si256((__m256i*)t.q[2 * c][4 * h + j], lo);
                _mm256_store_si256((__m256i*)t.q[2 * c + 1][4 * h + j], hi);
            }
        }
    // header: D[0] = (d, dmin) fp16, D[1..3] = the 12 bytes of 6-bit scales and mins
    __m256i D[4];
    load_rows_t(blk, 0, D);
    const __m256i k3F = _mm256_set1_epi8(0x3F), k30 = _mm256_set1_epi8(0x30);
    // bytes 0-3 of each lane: sc[0..3] / m[0..3] (low 6 bits of bytes 0-3 / 4-7), sc[4..7] /
    // m[4..7] (low / high nibble of bytes 8-11, topped by bits 6-7 of bytes 0-3 / 4-7 at 4-5)
    const __m256i scl = _mm256_and_si256(D[1], k3F), ml = _mm256_and_si256(D[2], k3F);
    const __m256i sch = _mm256_or_si256(_mm256_and_si256(D[3], m4), _mm256_and_si256(_mm256_srli_epi16(D[1], 2), k30));
    const __m256i mh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(D[3], 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(D[2], 2), k30));
    // d, dmin: the dwords' low and high halves, gathered into 128-bit halves
    const __m256i dd = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(D[0], _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9,
                                                    12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
        0xD8);
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
    const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm256_extracti128_si256(dd, 1)));
    _mm256_store_ps(t.d, d);
    for (int s = 0; s < 8; ++s) {
        const __m256i sv = s < 4 ? scl : sch, mv = s < 4 ? ml : mh;
#if defined(FT_HAVE_AVX_VNNI)
        _mm256_store_si256((__m256i*)t.sc[s], _mm256_shuffle_epi8(sv, kq_byte_ctl(s % 4, false)));
#else
        _mm256_store_si256((__m256i*)t.sc[s], _mm256_shuffle_epi8(sv, kq_byte_ctl(s % 4, true)));
#endif
        const __m256 m = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(mv, kq_byte_ctl(s % 4, false)));
        _mm256_store_ps((float*)t.aux[s], _mm256_mul_ps(m, ndmin));
    }
}

// The integer sum J of sub-block s (see the top of the file) for one token; w: the 8 step
// registers (two halves of 4), x16: the token's 32 codes of the sub-block as two 16-byte
// broadcasts.
template <int FMT>
static inline __m256i kq_tile_sum(const KqTile& t, int s, const __m256i* w, const __m256i* xb) {
#if defined(FT_HAVE_AVX_VNNI)
    __m256i J = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
        const __m256i* wh = w + 4 * h;
        const __m256i a = _mm256_dpbusd_avx_epi32(
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wh[0], _mm256_shuffle_epi32(xb[h], 0x00)), wh[1],
            _mm256_shuffle_epi32(xb[h], 0x55));
        const __m256i b = _mm256_dpbusd_avx_epi32(
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wh[2], _mm256_shuffle_epi32(xb[h], 0xAA)), wh[3],
            _mm256_shuffle_epi32(xb[h], 0xFF));
        const __m256i ab = _mm256_add_epi32(a, b);
        if (FMT == FT_FMT_Q6_K) J = _mm256_add_epi32(J, _mm256_mullo_epi32(ab, _mm256_load_si256((const __m256i*)t.sc[2 * s + h])));
        else J = _mm256_add_epi32(J, ab);
    }
    if (FMT != FT_FMT_Q6_K) J = _mm256_mullo_epi32(J, _mm256_load_si256((const __m256i*)t.sc[s]));
    return J;
#else
    __m256i p[4];  // int16 sums of 2 steps each
    for (int h = 0; h < 2; ++h) {
        const __m256i* wh = w + 4 * h;
        p[2 * h] = _mm256_add_epi16(_mm256_maddubs_epi16(wh[0], _mm256_shuffle_epi32(xb[h], 0x00)),
                                    _mm256_maddubs_epi16(wh[1], _mm256_shuffle_epi32(xb[h], 0x55)));
        p[2 * h + 1] = _mm256_add_epi16(_mm256_maddubs_epi16(wh[2], _mm256_shuffle_epi32(xb[h], 0xAA)),
                                        _mm256_maddubs_epi16(wh[3], _mm256_shuffle_epi32(xb[h], 0xFF)));
    }
    if (FMT == FT_FMT_Q4_K) {
        const __m256i q = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        return _mm256_madd_epi16(q, _mm256_load_si256((const __m256i*)t.sc[s]));
    }
    if (FMT == FT_FMT_Q5_K) {
        const __m256i sc = _mm256_load_si256((const __m256i*)t.sc[s]);
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), sc),
                                _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), sc));
    }
    const __m256i s0 = _mm256_load_si256((const __m256i*)t.sc[2 * s]), s1 = _mm256_load_si256((const __m256i*)t.sc[2 * s + 1]);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], s0), _mm256_madd_epi16(p[1], s0)),
                            _mm256_add_epi32(_mm256_madd_epi16(p[2], s1), _mm256_madd_epi16(p[3], s1)));
#endif
}

// NT tokens (x[j]: the token's blocks) against the 8 rows of nb tiles; tot[j] lane r: row r.
// Per block the sums scaled by the activation scales gather in acc (times d once per block).
template <int FMT, int NT>
static inline void kq_tiles_dot(const KqTile* tiles, uint32_t nb, const BlockQ8xK* const* x, __m256* tot) {
    for (int j = 0; j < NT; ++j) tot[j] = _mm256_setzero_ps();
    for (uint32_t b = 0; b < nb; ++b) {
        const KqTile& t = tiles[b];
        __m256 acc[NT];
        for (int j = 0; j < NT; ++j) acc[j] = _mm256_setzero_ps();
        for (int s = 0; s < 8; ++s) {
            __m256i w[8];
            for (int k = 0; k < 8; ++k) w[k] = _mm256_load_si256((const __m256i*)t.q[s][k]);
            for (int j = 0; j < NT; ++j) {
                const BlockQ8xK& xb = x[j][b];
                const __m256i xq[2] = {_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb.qs + 32 * s))),
                                       _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb.qs + 32 * s + 16)))};
                __m256i J = kq_tile_sum<FMT>(t, s, w, xq);
                if (FMT == FT_FMT_Q6_K) {
                    int32_t bs;
                    std::memcpy(&bs, xb.bsums + 2 * s, 4);
                    J = _mm256_add_epi32(J, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)t.aux[s]), _mm256_set1_epi32(bs)));
                }
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(J), _mm256_broadcast_ss(xb.d + s), acc[j]);
                if (FMT != FT_FMT_Q6_K)
                    tot[j] = _mm256_fmadd_ps(_mm256_load_ps((const float*)t.aux[s]), _mm256_broadcast_ss(xb.xs32 + s), tot[j]);
            }
        }
        const __m256 d = _mm256_load_ps(t.d);
        for (int j = 0; j < NT; ++j) tot[j] = _mm256_fmadd_ps(acc[j], d, tot[j]);
    }
}

// Tokens per pass over a row group's tiles (each pass reads their activations once; 64
// tokens of 2048 columns are 450 KB, inside L2).
constexpr uint32_t kKqTileTokens = 64;

template <int FMT>
static void dot_rows_kquant_tiles(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1, const void* const* xs,
                                  uint32_t ntok, float* out, size_t os) {
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    thread_local std::vector<KqTile> tiles;
    if (tiles.size() < nb) tiles.resize(nb);
    const BlockQ8xK* xv[4];
    for (uint32_t t0 = 0; t0 < ntok; t0 += kKqTileTokens) {
        const uint32_t t1 = std::min(ntok, t0 + kKqTileTokens);
        for (uint32_t g = r0; g < r1; g += 8) {
            const uint32_t n = std::min(8u, r1 - g);
            unpack_row_group8<BB>(base, w.row_stride, g, r1, nb,
                                  [&](const uint8_t* const* blk, uint32_t b) { kq_tile_unpack<FMT>(blk, tiles[b]); });
            for (uint32_t j0 = t0; j0 < t1; j0 += 4) {
                const uint32_t nt = std::min(4u, t1 - j0);
                for (uint32_t j = 0; j < nt; ++j) xv[j] = (const BlockQ8xK*)xs[j0 + j];
                __m256 v[4];
                switch (nt) {
                    case 4: kq_tiles_dot<FMT, 4>(tiles.data(), nb, xv, v); break;
                    case 3: kq_tiles_dot<FMT, 3>(tiles.data(), nb, xv, v); break;
                    case 2: kq_tiles_dot<FMT, 2>(tiles.data(), nb, xv, v); break;
                    default: kq_tiles_dot<FMT, 1>(tiles.data(), nb, xv, v); break;
                }
                for (uint32_t j = 0; j < nt; ++j) {
                    store_row_group8(out + (size_t)(j0 + j) * os + (g - r0), v[j], n);
                }
            }
        }
    }
}
