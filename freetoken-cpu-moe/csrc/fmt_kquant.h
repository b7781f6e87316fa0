// GGUF K-quant weights (Q4_K, Q5_K, Q6_K; super-blocks of 256) against int8
// activation super-blocks (BlockQ8xK). Portable version: each weight block is
// unpacked once to unsigned 8-bit codes and multiplied with every token's block.
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

struct KBlockDecoded {
    uint8_t q[256];      // unsigned codes: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (value = code - 32)
    int32_t scale[16];   // Q4/Q5: 8 sub-block scales (per 32); Q6: 16 scales (per 16)
    int32_t minv[8];     // Q4/Q5: 8 sub-block mins
    float d, dmin;
};

static inline void kq_scale_min(const uint8_t* s, int j, int32_t* sc, int32_t* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void decode_q4_k(const uint8_t* blk, KBlockDecoded& o) {
    uint16_t h;
    std::memcpy(&h, blk, 2); o.d = half_to_float(h);
    std::memcpy(&h, blk + 2, 2); o.dmin = half_to_float(h);
    for (int j = 0; j < 8; ++j) kq_scale_min(blk + 4, j, &o.scale[j], &o.minv[j]);
    const uint8_t* qs = blk + 16;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            o.q[64 * c + l] = qs[32 * c + l] & 0xF;
            o.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
}

static inline void decode_q5_k(const uint8_t* blk, KBlockDecoded& o) {
    uint16_t h;
    std::memcpy(&h, blk, 2); o.d = half_to_float(h);
    std::memcpy(&h, blk + 2, 2); o.dmin = half_to_float(h);
    for (int j = 0; j < 8; ++j) kq_scale_min(blk + 4, j, &o.scale[j], &o.minv[j]);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + 48;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            o.q[64 * c + l] = (uint8_t)((qs[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4));
            o.q[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
        }
}

static inline void decode_q6_k(const uint8_t* blk, KBlockDecoded& o) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = (const int8_t*)(blk + 192);
    uint16_t h;
    std::memcpy(&h, blk + 208, 2); o.d = half_to_float(h);
    o.dmin = 0.0f;
    for (int g = 0; g < 16; ++g) o.scale[g] = sc[g];
    for (int n = 0; n < 2; ++n) {
        const uint8_t* l8 = ql + 64 * n;
        const uint8_t* h8 = qh + 32 * n;
        uint8_t* q = o.q + 128 * n;
        for (int l = 0; l < 32; ++l) {
            q[l] = (uint8_t)((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4));
            q[l + 32] = (uint8_t)((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4));
            q[l + 64] = (uint8_t)((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4));
            q[l + 96] = (uint8_t)((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4));
        }
    }
}

static inline int32_t dot_u8i8_16(const uint8_t* a, const int8_t* b) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

// One decoded block against one activation block.
static inline float kblock_dot_q45(const KBlockDecoded& k, const BlockQ8xK& x) {
    float acc_sc = 0.0f, acc_m = 0.0f;
    for (int s = 0; s < 8; ++s) {
        const int32_t sumi = dot_u8i8_16(k.q + 32 * s, x.qs + 32 * s) + dot_u8i8_16(k.q + 32 * s + 16, x.qs + 32 * s + 16);
        acc_sc += x.d[s] * (float)(k.scale[s] * sumi);
        acc_m += x.d[s] * (float)(k.minv[s] * ((int32_t)x.bsums[2 * s] + (int32_t)x.bsums[2 * s + 1]));
    }
    return k.d * acc_sc - k.dmin * acc_m;
}
static inline float kblock_dot_q6(const KBlockDecoded& k, const BlockQ8xK& x) {
    float acc = 0.0f;
    for (int s = 0; s < 8; ++s) {
        const int32_t a = k.scale[2 * s] * (dot_u8i8_16(k.q + 32 * s, x.qs + 32 * s) - 32 * (int32_t)x.bsums[2 * s]);
        const int32_t b = k.scale[2 * s + 1] * (dot_u8i8_16(k.q + 32 * s + 16, x.qs + 32 * s + 16) - 32 * (int32_t)x.bsums[2 * s + 1]);
        acc += x.d[s] * (float)(a + b);
    }
    return k.d * acc;
}

template <int FMT>
static void dot_rows_kquant_portable(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                     const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK_K;
    constexpr size_t BB = FMT == FT_FMT_Q4_K ? Q4_K_BYTES : (FMT == FT_FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES);
    KBlockDecoded k;
    for (uint32_t r = r0; r < r1; ++r) {
        const uint8_t* row = base + (size_t)r * w.row_stride;
        for (uint32_t j = 0; j < ntok; ++j) out[j * os + (r - r0)] = 0.0f;
        for (uint32_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + (size_t)b * BB;
            if (FMT == FT_FMT_Q4_K) decode_q4_k(blk, k);
            else if (FMT == FT_FMT_Q5_K) decode_q5_k(blk, k);
            else decode_q6_k(blk, k);
            for (uint32_t j = 0; j < ntok; ++j) {
                const BlockQ8xK& xb = ((const BlockQ8xK*)xs[j])[b];
                out[j * os + (r - r0)] += FMT == FT_FMT_Q6_K ? kblock_dot_q6(k, xb) : kblock_dot_q45(k, xb);
            }
        }
    }
}
