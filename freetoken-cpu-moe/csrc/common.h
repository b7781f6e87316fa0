// Shared definitions of the CPU expert kernels: formats, prepared-activation
// layouts, the per-ISA kernel table, and portable numeric conversions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "freetoken/handoff.h"

namespace ft {

// ---- weight block geometry (GGUF layouts, ggml type ids) -------------------
constexpr uint32_t QK8_0 = 32;    // Q8_0: fp16 d, int8 qs[32]                       (34 bytes)
constexpr uint32_t QK_K = 256;    // K-quant super-block
constexpr size_t Q8_0_BYTES = 34;
constexpr size_t Q4_K_BYTES = 144;  // fp16 d, fp16 dmin, scales[12], qs[128]
constexpr size_t Q5_K_BYTES = 176;  // fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
constexpr size_t Q6_K_BYTES = 210;  // ql[128], qh[64], int8 scales[16], fp16 d
constexpr uint32_t QK_MXFP4 = 32;  // MXFP4: E8M0 e, 4-bit codes qs[16]                  (17 bytes)
constexpr size_t MXFP4_BYTES = 17;
constexpr uint32_t FP8_BLOCK = 128;  // FP8 E4M3 scale block (rows and cols)

// Elements per block and bytes per block of a weight format (0 if unknown).
static inline uint32_t block_elems(uint32_t fmt) {
    switch (fmt) {
        case FT_FMT_F32: case FT_FMT_F16: case FT_FMT_BF16: case FT_FMT_FP8_E4M3_B128: return 1;
        case FT_FMT_Q8_0: return QK8_0;
        case FT_FMT_MXFP4: return QK_MXFP4;
        case FT_FMT_Q4_K: case FT_FMT_Q5_K: case FT_FMT_Q6_K: return QK_K;
        default: return 0;
    }
}
static inline size_t block_bytes(uint32_t fmt) {
    switch (fmt) {
        case FT_FMT_F32: return 4;
        case FT_FMT_F16: case FT_FMT_BF16: return 2;
        case FT_FMT_FP8_E4M3_B128: return 1;
        case FT_FMT_Q8_0: return Q8_0_BYTES;
        case FT_FMT_MXFP4: return MXFP4_BYTES;
        case FT_FMT_Q4_K: return Q4_K_BYTES;
        case FT_FMT_Q5_K: return Q5_K_BYTES;
        case FT_FMT_Q6_K: return Q6_K_BYTES;
        default: return 0;
    }
}
static inline size_t row_bytes(uint32_t fmt, uint32_t cols) {
    uint32_t be = block_elems(fmt);
    return be ? (size_t)(cols / be) * block_bytes(fmt) : 0;
}

// ---- prepared activations ---------------------------------------------------
// Each weight format multiplies against the activation prepared the way its dot
// product wants it: float formats read float32, Q8_0 reads int8 blocks of 32,
// the K-quants read int8 super-blocks of 256 (scale per 32, sums per 16).
enum ActKind : int { ACT_F32 = 0, ACT_Q8_32 = 1, ACT_Q8_K = 2 };

// ACT_Q8_32 (for Q8_0 and MXFP4 weights), structure of arrays over a vector of n elements:
//   int8 qs[n] | float d[n/32] (x ~= d[i/32] * qs[i]) | float dq[n/32] (= d * sum of the block's qs)
struct ActQ8x32View {
    const int8_t* qs;
    const float* d;
    const float* dq;
};
static inline size_t q8x32_d_offset(uint32_t n) { return ((size_t)n + 63) & ~(size_t)63; }
static inline ActQ8x32View q8x32_view(const void* p, uint32_t n) {
    const uint8_t* b = (const uint8_t*)p;
    ActQ8x32View v;
    v.qs = (const int8_t*)b;
    v.d = (const float*)(b + q8x32_d_offset(n));
    v.dq = v.d + n / 32;
    return v;
}

// ACT_Q8_K (for Q4_K/Q5_K/Q6_K weights): one block per 256 elements. The portable
// and AVX2 kernels read d/bsums/qs/xs16/xs32; the AVX-512 kernels read the copies
// laid out the way their registers hold the weights (see fmt_kquant_avx512.h).
struct BlockQ8xK {
    float d[8];           // x ~= d[i / 32] * qs[i]: a scale per 32 (h is heavy-tailed); on the AVX2
                          // tiers one scale per 256 (all eight equal, see act_prepare.h)
    int16_t bsums[16];    // sums of qs over each group of 16
    int8_t qs[256];       // natural order (also the Q6_K register order)
    int8_t qs4k[256];     // Q4_K/Q5_K register order (kq45_act_index)
    float xdm4[16];       // Q4_K: [d[s] (odd s: / 16), -xs32[s]] interleaved over s
    float xdm5[16];       // Q5_K: [d[s] (odd s: / 8), -xs32[s]] interleaved over s
    float dx16[16];       // Q6_K: d[g / 2] / k, k = 4 for groups 6, 7 of each 128 (4 x code there), else 1
    float xs16[16];       // d[g / 2] * bsums[g]
    float xs32[8];        // d[s] * (sum of qs over sub-block s of 32)
    int16_t bsums32[8];   // sums of qs over each sub-block of 32
    float pad[4];
};
static_assert(sizeof(BlockQ8xK) == 896, "BlockQ8xK layout");

// Element of the 256-block that byte i (0..255) of BlockQ8xK::qs4k multiplies. The
// AVX-512 Q4_K/Q5_K kernels hold a block in four registers of 64 bytes: A0, B0 from
// qs bytes 0-63 (chunks 0, 1), A1, B1 from bytes 64-127 (chunks 2, 3). Chunk c byte j
// holds element 64c + j in its low nibble and 64c + 32 + j in its high nibble. A keeps
// the low nibbles in even dword lanes and the high nibbles in odd ones; B does the
// same after swapping each pair of dwords (byte p reads byte p ^ 4). Both then map
// dword lane l of a 64-byte half to sub-block 2c + (l & 1), c = the chunk of l / 8.
static inline uint32_t kq45_act_index(uint32_t i) {
    const uint32_t reg = i / 64, p = i % 64;
    const uint32_t src = (reg & 1) ? (p ^ 4) : p;  // byte of the 64-byte half of qs
    const uint32_t c = 2 * (reg / 2) + src / 32;
    return 64 * c + (src % 32) + (((p / 4) & 1) ? 32 : 0);
}

static inline ActKind act_kind_for(uint32_t fmt) {
    switch (fmt) {
        case FT_FMT_Q8_0: case FT_FMT_MXFP4: return ACT_Q8_32;
        case FT_FMT_Q4_K: case FT_FMT_Q5_K: case FT_FMT_Q6_K: return ACT_Q8_K;
        default: return ACT_F32;
    }
}
// Bytes of one prepared activation vector of n elements (rounded to 64).
static inline size_t act_bytes(ActKind kind, uint32_t n) {
    size_t b = 0;
    switch (kind) {
        case ACT_F32: b = (size_t)n * 4; break;
        case ACT_Q8_32: b = q8x32_d_offset(n) + (size_t)(n / 32) * 8; break;
        case ACT_Q8_K: b = (size_t)(n / 256) * sizeof(BlockQ8xK); break;
    }
    return (b + 63) & ~(size_t)63;
}

// ---- the per-ISA kernel table ----------------------------------------------
struct KernelTable {
    const char* name;
    // Prepare x[n] (float32) as `kind` into out (act_bytes(kind, n) bytes).
    void (*prepare)(int kind, const float* x, uint32_t n, void* out);
    // out[j * out_stride + (r - r0)] = dot(W[expert][r], x_j) for r in [r0, r1),
    // j in [0, ntok); xs[j] is x_j prepared as act_kind_for(w.format).
    void (*dot_rows)(const ft_weight_desc& w, uint32_t expert, uint32_t r0, uint32_t r1,
                     const void* const* xs, uint32_t ntok, float* out, size_t out_stride);
    // Read n bytes (n % 64 == 0) as fast as this tier can; returns a checksum.
    uint64_t (*stream)(const uint8_t* p, size_t n);
};

// MXFP4 on the AVX-512 tiers: the AVX512-VBMI byte permutes (fmt_mxfp4.h) when the CPU has
// them and they are on (the default where supported; set_mxfp4_vbmi(false) runs the other
// path, for tests and A/B timings). set_mxfp4_vbmi returns the previous setting and throws
// std::invalid_argument when asked to turn them on without CPU support.
bool mxfp4_vbmi();
bool set_mxfp4_vbmi(bool on);

const KernelTable* kernels_scalar();
const KernelTable* kernels_avx_vnni();  // the avx2 tier's kernels with AVX-VNNI dot products
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_amx();

// ---- bit-exact scalar conversions -------------------------------------------
static inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    float f;
    if (em >= 0x7c00u) {
        f = bits_to_float((em << 13) | 0x7f800000u);  // inf / nan
    } else if (em >= 0x0400u) {
        f = bits_to_float((em << 13) + (112u << 23));  // normal: exponent bias 15 -> 127
    } else {
        f = (float)em * 0x1p-24f;  // subnormal or zero, exactly (no float32 subnormal: safe under DAZ)
    }
    return bits_to_float(float_to_bits(f) | sign);
}

static inline uint16_t float_to_half(float v) {  // round to nearest even
    uint32_t u = float_to_bits(v);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint16_t o;
    if (u >= 0x7f800000u) {
        o = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u;
    } else if (u >= (uint32_t)(127 + 16) << 23) {
        o = 0x7c00u;
    } else if (u < (uint32_t)113 << 23) {
        float f = bits_to_float(u) + 0.5f;           // subnormal: align to 2^-24
        o = (uint16_t)(float_to_bits(f) - float_to_bits(0.5f));
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(u >> 13);
    }
    return (uint16_t)(o | sign);
}

static inline float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }
static inline uint16_t float_to_bf16(float v) {
    uint32_t u = float_to_bits(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet nan
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// FP8 E4M3 (OCP "fn": bias 7, no inf, 0x7f/0xff nan).
static inline float fp8_e4m3_to_float(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
    float f;
    if (e == 0xfu && m == 0x7u) f = bits_to_float(0x7fc00000u);
    else if (e == 0) f = (float)m * 0x1p-9f;
    else f = bits_to_float(((e + 120u) << 23) | (m << 20));
    return bits_to_float(float_to_bits(f) | sign);
}

}  // namespace ft
