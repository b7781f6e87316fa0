// AMX kernels for many tokens against the same rows (prefill, large batches): the
// rows of a call are cut into tiles of 16 and multiplied with tiles of 16 tokens
// by the matrix unit. Included inside the "amx" ISA namespace (kernels_isa.inc).
//
// Integer formats (Q4_K, Q5_K, Q6_K, Q8_0) keep the numerics of the vector kernels
// exactly: the same int8 activation codes and scales (BlockQ8xK / ActQ8x32View), the
// weights' integer codes, int32 sums per scale group (32 elements; 16 for Q6_K) from
// TDPBUSD (unsigned codes x int8) or TDPBSSD (Q8_0), then the same float scaling
// per group: y += sum * (weight scale x activation scale) - weight min x activation
// group sum. Only the float32 summation order differs.
// BF16 and FP8 weights are exact in BF16; float32 activations are split into two
// BF16 halves (hi = bf16(x), lo = bf16(x - hi), 16 significant bits together) and
// both go through TDPBF16PS, so the result keeps float32-class accuracy (~1e-6).
//
// Operands: A = 16 weight rows x K (codes decoded into a per-thread buffer, or Q8_0 /
// BF16 rows read in place), B = K x 16 tokens in the tiles' dword-interleaved layout
// (packed once per call), C = 16 rows x 16 tokens of int32 or float32.
#pragma once

#include <cstdlib>
#include <new>

// Tokens from which a call takes the matrix path; below it the vector kernels, which
// read the weights once for up to 4 tokens, are as fast (measured on the 2-core VM,
// one thread, 768 x 2048: K-quants break even near 12 tokens, Q8_0, BF16 and FP8 near 6).
static inline uint32_t amx_min_tokens(uint32_t fmt) {
    return fmt == FT_FMT_Q4_K || fmt == FT_FMT_Q5_K || fmt == FT_FMT_Q6_K ? 16 : 8;
}

struct AmxTileCfg {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileCfg) == 64, "AMX tile configuration is 64 bytes");

// Tile registers. Integer path: 0-3 accumulators of four groups in flight, 4, 5
// weights, 6, 7 activations. BF16 path: 0, 1 accumulators, 2 weights, 4-7 activations.
struct AmxTiles {
    uint8_t rows[8];
    uint16_t colsb[8];
};
static inline void amx_configure(const AmxTiles& t) {
    AmxTileCfg c;
    for (int i = 0; i < 8; ++i) {
        c.rows[i] = t.rows[i];
        c.colsb[i] = t.colsb[i];
    }
    _tile_loadconfig(&c);
}
// Integer path, K = kg bytes per group: A 16 x kg, B kg / 4 x 64.
static inline AmxTiles amx_int_tiles(uint32_t kg) {
    const uint8_t br = (uint8_t)(kg / 4);
    return AmxTiles{{16, 16, 16, 16, 16, 16, br, br}, {64, 64, 64, 64, (uint16_t)kg, (uint16_t)kg, 64, 64}};
}
// BF16 path: A 16 x 32 bf16, B 16 x 64.
static inline AmxTiles amx_bf16_tiles() {
    return AmxTiles{{16, 16, 16, 0, 16, 16, 16, 16}, {64, 64, 64, 0, 64, 64, 64, 64}};
}
#define FT_TC0 0
#define FT_TC1 1
#define FT_TA0 2
#define FT_TB0 4
#define FT_TB1 5
#define FT_TB2 6
#define FT_TB3 7

struct AmxScratch {
    AlignedBuffer act, weights, scales;
};
static thread_local AmxScratch tls_amx;

// out[c] = column c of the 16 x 16 dword matrix in[0..16) (a transpose).
static inline void transpose16_epi32(const __m512i* in, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    // u[4g + j], 128-bit lane L: rows 4g..4g+3 of column 4L + j
    for (int g = 0; g < 4; ++g) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        out[0 + j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        out[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

// dst row k (64 bytes) = dword k of each of 16 sources (null: zeros), k < nd.
static inline void pack_dwords16(const uint8_t* const* src, uint32_t nd, uint8_t* dst) {
    __m512i in[16], out[16];
    for (uint32_t k0 = 0; k0 < nd; k0 += 16) {
        const uint32_t n = nd - k0 < 16 ? nd - k0 : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        for (int t = 0; t < 16; ++t)
            in[t] = src[t] ? _mm512_maskz_loadu_epi32(m, src[t] + 4 * (size_t)k0) : _mm512_setzero_si512();
        transpose16_epi32(in, out);
        for (uint32_t c = 0; c < n; ++c) _mm512_storeu_si512(dst + 64 * (size_t)(k0 + c), out[c]);
    }
}

// Rows r..r+16 of the tile accumulators acc[i] (lane t = token t) into out.
static inline void amx_store_out(const __m512* acc, uint32_t nt, float* out, size_t os) {
    __m512i in[16], tr[16];
    for (int i = 0; i < 16; ++i) in[i] = _mm512_castps_si512(acc[i]);
    transpose16_epi32(in, tr);
    for (uint32_t t = 0; t < nt; ++t) _mm512_storeu_si512(out + t * os, tr[t]);
}

// ---- integer formats --------------------------------------------------------
template <int FMT>
struct AmxIntFmt {
    static constexpr uint32_t KG = FMT == FT_FMT_Q6_K ? 16 : 32;  // elements per scale group
    static constexpr bool kMin = FMT != FT_FMT_Q8_0;               // a min / offset term per group
    static constexpr bool kDecoded = FMT != FT_FMT_Q8_0;           // codes unpacked into a buffer
};

// Activations of 16 tokens (j0..j0+nt) for the integer path: B rows (cols / 4 x 64
// bytes), then per scale group 16 activation scales and 16 group terms.
template <int FMT>
static void amx_pack_int(const void* const* xs, uint32_t j0, uint32_t nt, uint32_t cols, uint8_t* dst) {
    using F = AmxIntFmt<FMT>;
    const uint32_t ng = cols / F::KG;
    float* xd = (float*)(dst + (size_t)cols * 16);
    float* xm = xd + (size_t)ng * 16;
    const uint8_t* src[16];
    if (FMT == FT_FMT_Q8_0) {
        for (int t = 0; t < 16; ++t) src[t] = (uint32_t)t < nt ? (const uint8_t*)q8x32_view(xs[j0 + t], cols).qs : nullptr;
        pack_dwords16(src, cols / 4, dst);
        for (uint32_t g = 0; g < ng; ++g)
            for (int t = 0; t < 16; ++t) xd[g * 16 + t] = (uint32_t)t < nt ? q8x32_view(xs[j0 + t], cols).d[g] : 0.0f;
        return;
    }
    const uint32_t nb = cols / QK_K;
    for (uint32_t b = 0; b < nb; ++b) {
        for (int t = 0; t < 16; ++t) src[t] = (uint32_t)t < nt ? (const uint8_t*)((const BlockQ8xK*)xs[j0 + t])[b].qs : nullptr;
        pack_dwords16(src, 64, dst + (size_t)b * 64 * 64);
    }
    const uint32_t gpb = QK_K / F::KG;  // groups per block
    for (uint32_t g = 0; g < ng; ++g) {
        const uint32_t b = g / gpb, s = g % gpb;
        for (int t = 0; t < 16; ++t) {
            if ((uint32_t)t >= nt) {
                xd[g * 16 + t] = xm[g * 16 + t] = 0.0f;
                continue;
            }
            const BlockQ8xK& x = ((const BlockQ8xK*)xs[j0 + t])[b];
            if (FMT == FT_FMT_Q6_K) {
                xd[g * 16 + t] = x.d[s / 2];
                xm[g * 16 + t] = x.xs16[s];
            } else {
                xd[g * 16 + t] = x.d[s];
                xm[g * 16 + t] = x.xs32[s];
            }
        }
    }
}

// Codes of one Q4_K/Q5_K/Q6_K block in natural element order (unsigned).
template <int FMT>
static inline void amx_unpack_codes(const uint8_t* blk, uint8_t* q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (FMT == FT_FMT_Q4_K) {
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
            _mm256_storeu_si256((__m256i*)(q + 64 * c), _mm256_and_si256(v, m4));
            _mm256_storeu_si256((__m256i*)(q + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
    } else if (FMT == FT_FMT_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16)), one = _mm256_set1_epi8(1);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 48 + 32 * c));
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4);
            _mm256_storeu_si256((__m256i*)(q + 64 * c), _mm256_or_si256(_mm256_and_si256(v, m4), h0));
            _mm256_storeu_si256((__m256i*)(q + 64 * c + 32),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1));
        }
    } else {
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int n = 0; n < 2; ++n) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
            uint8_t* o = q + 128 * n;
            auto hb = [&](int sh) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, sh), m3), 4); };
            _mm256_storeu_si256((__m256i*)o, _mm256_or_si256(_mm256_and_si256(l0, m4), hb(0)));
            _mm256_storeu_si256((__m256i*)(o + 32), _mm256_or_si256(_mm256_and_si256(l1, m4), hb(2)));
            _mm256_storeu_si256((__m256i*)(o + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hb(4)));
            _mm256_storeu_si256((__m256i*)(o + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hb(6)));
        }
    }
}

// 16 rows of weights: codes (decoded formats) into q[16][cols], and per row and
// scale group the pair (weight scale, weight min term) into cm[16][ng][2].
// Codes go group-major, q[group][row][KG], so that each A tile is 512 contiguous bytes.
template <int FMT>
static void amx_decode_rows(const uint8_t* rows, size_t row_stride, uint32_t cols, uint8_t* q, float* cm) {
    using F = AmxIntFmt<FMT>;
    const uint32_t ng = cols / F::KG;
    if (FMT == FT_FMT_Q8_0) {
        const uint32_t nb = cols / QK8_0;
        const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32((int)Q8_0_BYTES));
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        for (int i = 0; i < 16; ++i) {
            const uint8_t* row = rows + (size_t)i * row_stride;
            float* c = cm + (size_t)i * ng * 2;
            for (uint32_t b = 0; b < nb; b += 16) {
                const uint32_t m = nb - b < 16 ? nb - b : 16;
                const __mmask16 mk = (__mmask16)((1u << m) - 1u);
                const __m512i dh = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, gidx, row + (size_t)b * Q8_0_BYTES, 1);
                const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh)), z = _mm512_setzero_ps();
                alignas(64) float tmp[32];
                _mm512_store_ps(tmp, _mm512_permutex2var_ps(d, lo, z));
                _mm512_store_ps(tmp + 16, _mm512_permutex2var_ps(d, hi, z));
                std::memcpy(c + 2 * b, tmp, (size_t)m * 8);
            }
        }
        return;
    }
    static const Kq45ScaleCtl kc;
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    const uint32_t nb = cols / QK_K;
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int i = 0; i < 16; ++i) {
        const uint8_t* row = rows + (size_t)i * row_stride;
        float* c = cm + (size_t)i * ng * 2;
        for (uint32_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + (size_t)b * BB;
            alignas(64) uint8_t codes[QK_K];
            amx_unpack_codes<FMT>(blk, codes);
            for (uint32_t s = 0; s < QK_K / F::KG; ++s)  // group-major: A tiles are contiguous
                std::memcpy(q + ((size_t)(b * (QK_K / F::KG) + s) * 16 + i) * F::KG, codes + s * F::KG, F::KG);
            if (FMT == FT_FMT_Q6_K) {
                const float d = half_to_float((uint16_t)(blk[208] | (blk[209] << 8)));
                const __m512 s = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)))), _mm512_set1_ps(d));
                const __m512 m = _mm512_mul_ps(s, _mm512_set1_ps(32.0f));  // the -32 offset of the codes
                _mm512_storeu_ps(c + 32 * b, _mm512_permutex2var_ps(s, lo, m));
                _mm512_storeu_ps(c + 32 * b + 16, _mm512_permutex2var_ps(s, hi, m));
            } else {
                _mm512_storeu_ps(c + 16 * b, kq45_scales(blk, kc));  // [d sc0, dmin m0, d sc1, ...]
            }
        }
    }
}

// Group g into accumulator tile g % 4 (weights and activations in tiles 4 + g % 2,
// 6 + g % 2): four groups in flight hide the matrix unit's latency.
#define FT_AMX_INT_TILE(TC, TA, TB, G)                                                         \
    do {                                                                                       \
        _tile_zero(TC);                                                                        \
        _tile_loadd(TA, abase + (size_t)(G) * a_gstep, a_stride);                             \
        _tile_loadd(TB, bq + (size_t)(G) * (F::KG / 4) * 64, 64);                              \
        if (FMT == FT_FMT_Q8_0) _tile_dpbssd(TC, TA, TB);                                      \
        else _tile_dpbusd(TC, TA, TB);                                                         \
    } while (0)
#define FT_AMX_INT_ISSUE(G)                                         \
    do {                                                            \
        switch ((G) & 3) {                                          \
            case 0: FT_AMX_INT_TILE(0, 4, 6, G); break;             \
            case 1: FT_AMX_INT_TILE(1, 5, 7, G); break;             \
            case 2: FT_AMX_INT_TILE(2, 4, 6, G); break;             \
            default: FT_AMX_INT_TILE(3, 5, 7, G); break;            \
        }                                                           \
    } while (0)

template <int FMT>
static inline void amx_int_epilogue(const int32_t* cbuf, const float* cm, uint32_t ng, uint32_t g, const float* xd,
                                    const float* xm, __m512* acc) {
    const __m512 xdv = _mm512_loadu_ps(xd + (size_t)g * 16);
    const __m512 xmv = _mm512_loadu_ps(xm + (size_t)g * 16);
    for (int i = 0; i < 16; ++i) {
        const float* c = cm + ((size_t)i * ng + g) * 2;
        const __m512 coef = _mm512_mul_ps(_mm512_set1_ps(c[0]), xdv);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 16 * i)), coef, acc[i]);
        if (AmxIntFmt<FMT>::kMin) acc[i] = _mm512_fnmadd_ps(_mm512_set1_ps(c[1]), xmv, acc[i]);
    }
}

// Rows [r0, r0 + 16 * ntiles) of expert base against ntok tokens.
template <int FMT>
static void amx_rows_int(const ft_weight_desc& w, const uint8_t* base, uint32_t r0, uint32_t ntiles,
                         const void* const* xs, uint32_t ntok, float* out, size_t os) {
    using F = AmxIntFmt<FMT>;
    const uint32_t cols = w.cols, ng = cols / F::KG, ntt = (ntok + 15) / 16;
    const size_t tile_bytes = (size_t)cols * 16 + (size_t)ng * 16 * 4 * 2;
    uint8_t* act = tls_amx.act.reserve(tile_bytes * ntt);
    for (uint32_t tt = 0; tt < ntt; ++tt) {
        const uint32_t nt = ntok - 16 * tt < 16 ? ntok - 16 * tt : 16;
        amx_pack_int<FMT>(xs, 16 * tt, nt, cols, act + tile_bytes * tt);
    }
    uint8_t* q = F::kDecoded ? tls_amx.weights.reserve((size_t)16 * cols) : nullptr;
    float* cm = (float*)tls_amx.scales.reserve((size_t)16 * ng * 2 * 4);
    alignas(64) int32_t cbuf[256];
    amx_configure(amx_int_tiles(F::KG));
    for (uint32_t rt = 0; rt < ntiles; ++rt) {
        const uint8_t* rows = base + (size_t)(r0 + 16 * rt) * w.row_stride;
        amx_decode_rows<FMT>(rows, w.row_stride, cols, q, cm);
        const uint8_t* abase = F::kDecoded ? q : rows + 2;
        const size_t a_gstep = F::kDecoded ? 16 * F::KG : Q8_0_BYTES, a_stride = F::kDecoded ? F::KG : w.row_stride;
        for (uint32_t tt = 0; tt < ntt; ++tt) {
            const uint32_t nt = ntok - 16 * tt < 16 ? ntok - 16 * tt : 16;
            const uint8_t* bq = act + tile_bytes * tt;
            const float* xd = (const float*)(bq + (size_t)cols * 16);
            const float* xm = xd + (size_t)ng * 16;
            __m512 acc[16];
            for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
            // the matrix unit computes groups g + 1..g + 3 while the vector units scale group g
            for (uint32_t g = 0; g < 3 && g < ng; ++g) FT_AMX_INT_ISSUE(g);
            for (uint32_t g = 0; g < ng; ++g) {
                switch (g & 3) {
                    case 0: _tile_stored(0, cbuf, 64); break;
                    case 1: _tile_stored(1, cbuf, 64); break;
                    case 2: _tile_stored(2, cbuf, 64); break;
                    default: _tile_stored(3, cbuf, 64); break;
                }
                if (g + 3 < ng) FT_AMX_INT_ISSUE(g + 3);
                amx_int_epilogue<FMT>(cbuf, cm, ng, g, xd, xm, acc);
            }
            amx_store_out(acc, nt, out + (size_t)16 * tt * os + 16 * rt, os);
        }
    }
    _tile_release();
}
#undef FT_AMX_INT_ISSUE
#undef FT_AMX_INT_TILE

// ---- BF16 and FP8 -----------------------------------------------------------
// Activations of 16 tokens as bf16 pairs: B rows of hi (cols / 2 x 64 bytes), then of lo.
static void amx_pack_bf16(const void* const* xs, uint32_t j0, uint32_t nt, uint32_t cols, uint8_t* dst, uint8_t* tmp) {
    const uint8_t* src[16];
    const size_t half = (size_t)cols * 2;  // bytes of one token's bf16 row
    for (int t = 0; t < 16; ++t) src[t] = nullptr;
    for (uint32_t t = 0; t < nt; ++t) {
        const float* x = (const float*)xs[j0 + t];
        uint8_t* hi = tmp + 2 * half * t;
        uint8_t* lo = hi + half;
        for (uint32_t c = 0; c < cols; c += 32) {
            const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
            const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
            const __m512i hb = (__m512i)h;
            const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hb)), 16));
            const __m512 hbv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hb, 1)), 16));
            const __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hbv), _mm512_sub_ps(a, ha));
            _mm512_storeu_si512(hi + 2 * (size_t)c, hb);
            _mm512_storeu_si512(lo + 2 * (size_t)c, (__m512i)l);
        }
    }
    for (uint32_t t = 0; t < nt; ++t) src[t] = tmp + 2 * half * t;
    pack_dwords16(src, cols / 2, dst);
    for (uint32_t t = 0; t < nt; ++t) src[t] = tmp + 2 * half * t + half;
    pack_dwords16(src, cols / 2, dst + (size_t)cols * 32);
}

// FP8 E4M3 rows -> bf16 (value / 256, exact: see load16_fp8_div256).
static inline void amx_fp8_to_bf16(const uint8_t* row, uint32_t cols, uint8_t* dst) {
    for (uint32_t c = 0; c < cols; c += 32) {
        const __m512i h = _mm512_and_si512(
            _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(row + c))), 7),
            _mm512_set1_epi16((short)0xBF80));
        const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        _mm512_storeu_si512(dst + 2 * (size_t)c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Rows [r0, r0 + 16 * ntiles) (r0 a multiple of 16) of a BF16 or FP8 expert.
template <int FMT>
static void amx_rows_bf16(const ft_weight_desc& w, uint32_t e, const uint8_t* base, uint32_t r0, uint32_t ntiles,
                          const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint32_t cols = w.cols, nk = cols / 32, ntt = (ntok + 15) / 16;
    const size_t tile_bytes = (size_t)cols * 64;  // hi and lo B rows of 16 tokens
    uint8_t* act = tls_amx.act.reserve(tile_bytes * ntt + (size_t)cols * 64);
    uint8_t* tmp = act + tile_bytes * ntt;
    for (uint32_t tt = 0; tt < ntt; ++tt) {
        const uint32_t nt = ntok - 16 * tt < 16 ? ntok - 16 * tt : 16;
        amx_pack_bf16(xs, 16 * tt, nt, cols, act + tile_bytes * tt, tmp);
    }
    const bool fp8 = FMT == FT_FMT_FP8_E4M3_B128;
    uint8_t* wb = fp8 ? tls_amx.weights.reserve((size_t)16 * cols * 2) : nullptr;
    const uint32_t ncb = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const float* sbase = fp8 ? (const float*)((const uint8_t*)(uintptr_t)w.scale + (size_t)e * w.scale_expert_stride) : nullptr;
    alignas(64) float cbuf[2][256];
    alignas(64) float accm[2][256];
    amx_configure(amx_bf16_tiles());
    for (uint32_t rt = 0; rt < ntiles; ++rt) {
        const uint32_t r = r0 + 16 * rt;
        const uint8_t* rows = base + (size_t)r * w.row_stride;
        const uint8_t* abase = rows;
        size_t a_stride = w.row_stride;
        if (fp8) {
            for (int i = 0; i < 16; ++i) amx_fp8_to_bf16(rows + (size_t)i * w.row_stride, cols, wb + (size_t)i * cols * 2);
            abase = wb;
            a_stride = (size_t)cols * 2;
        }
        const float* srow = fp8 ? sbase + (size_t)(r / FP8_BLOCK) * ncb : nullptr;
        for (uint32_t tt = 0; tt < ntt; tt += 2) {
            const bool pair = tt + 1 < ntt;
            const uint8_t* b0 = act + tile_bytes * tt;
            const uint8_t* b1 = b0 + tile_bytes;
            const size_t lo_off = (size_t)cols * 32;
            if (fp8) std::memset(accm, 0, sizeof(accm));
            _tile_zero(FT_TC0);
            _tile_zero(FT_TC1);
            for (uint32_t k = 0; k < nk; ++k) {
                if (!fp8 && (k & 7) == 0)  // the rows' next lines: 16 streams, ahead of the tile loads
                    for (int i = 0; i < 16; ++i) _mm_prefetch((const char*)(abase + i * a_stride + 64 * k + 1024), _MM_HINT_T0);
                _tile_loadd(FT_TA0, abase + 64 * (size_t)k, a_stride);
                _tile_loadd(FT_TB0, b0 + 1024 * (size_t)k, 64);
                _tile_loadd(FT_TB1, b0 + lo_off + 1024 * (size_t)k, 64);
                _tile_dpbf16ps(FT_TC0, FT_TA0, FT_TB0);
                _tile_dpbf16ps(FT_TC0, FT_TA0, FT_TB1);
                if (pair) {
                    _tile_loadd(FT_TB2, b1 + 1024 * (size_t)k, 64);
                    _tile_loadd(FT_TB3, b1 + lo_off + 1024 * (size_t)k, 64);
                    _tile_dpbf16ps(FT_TC1, FT_TA0, FT_TB2);
                    _tile_dpbf16ps(FT_TC1, FT_TA0, FT_TB3);
                }
                if (fp8 && ((k + 1) % (FP8_BLOCK / 32) == 0 || k + 1 == nk)) {  // end of a 128-column scale block
                    const __m512 sv = _mm512_set1_ps(srow[k / (FP8_BLOCK / 32)] * 256.0f);
                    _tile_stored(FT_TC0, cbuf[0], 64);
                    _tile_zero(FT_TC0);
                    if (pair) {
                        _tile_stored(FT_TC1, cbuf[1], 64);
                        _tile_zero(FT_TC1);
                    }
                    for (int p = 0; p < (pair ? 2 : 1); ++p)
                        for (int i = 0; i < 16; ++i)
                            _mm512_store_ps(accm[p] + 16 * i, _mm512_fmadd_ps(_mm512_load_ps(cbuf[p] + 16 * i), sv,
                                                                             _mm512_load_ps(accm[p] + 16 * i)));
                }
            }
            if (!fp8) {
                _tile_stored(FT_TC0, accm[0], 64);
                if (pair) _tile_stored(FT_TC1, accm[1], 64);
            }
            for (int p = 0; p < (pair ? 2 : 1); ++p) {
                const uint32_t t0 = 16 * (tt + p), nt = ntok - t0 < 16 ? ntok - t0 : 16;
                __m512 acc[16];
                for (int i = 0; i < 16; ++i) acc[i] = _mm512_load_ps(accm[p] + 16 * i);
                amx_store_out(acc, nt, out + (size_t)t0 * os + 16 * rt, os);
            }
        }
    }
    _tile_release();
}

// The matrix path for rows [a, b) of dot_rows (a, b multiples of 16 from r0); false
// if the format or shape has none (the caller runs the vector kernels).
static bool amx_supported(const ft_weight_desc& w) {
    switch (w.format) {
        case FT_FMT_Q4_K: case FT_FMT_Q5_K: case FT_FMT_Q6_K: case FT_FMT_Q8_0: return true;
        case FT_FMT_BF16: case FT_FMT_FP8_E4M3_B128: return w.cols % 32 == 0;
        default: return false;
    }
}

static void amx_rows(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t ntiles, const void* const* xs,
                     uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    switch (w.format) {
        case FT_FMT_Q4_K: amx_rows_int<FT_FMT_Q4_K>(w, base, r0, ntiles, xs, ntok, out, os); break;
        case FT_FMT_Q5_K: amx_rows_int<FT_FMT_Q5_K>(w, base, r0, ntiles, xs, ntok, out, os); break;
        case FT_FMT_Q6_K: amx_rows_int<FT_FMT_Q6_K>(w, base, r0, ntiles, xs, ntok, out, os); break;
        case FT_FMT_Q8_0: amx_rows_int<FT_FMT_Q8_0>(w, base, r0, ntiles, xs, ntok, out, os); break;
        case FT_FMT_BF16: amx_rows_bf16<FT_FMT_BF16>(w, e, base, r0, ntiles, xs, ntok, out, os); break;
        case FT_FMT_FP8_E4M3_B128: amx_rows_bf16<FT_FMT_FP8_E4M3_B128>(w, e, base, r0, ntiles, xs, ntok, out, os); break;
        default: break;
    }
}
