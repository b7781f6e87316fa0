// Rows of activations stored as f32, f16 or bf16, read into and written from float32,
// and rounded through their storage format (the value a stored activation would have):
// the I/O of the per-token ops (decode_ops.cpp, deltanet.cpp).
#pragma once

#include <cstring>

#include "common.h"

namespace ft {
namespace act_rows {

inline bool is_act(uint32_t f) { return f == FT_FMT_F32 || f == FT_FMT_F16 || f == FT_FMT_BF16; }
inline size_t esize(uint32_t f) { return f == FT_FMT_F32 ? 4 : 2; }

inline void load(uint32_t fmt, const void* src, float* dst, uint32_t n) {
    switch (fmt) {
        case FT_FMT_F32: std::memcpy(dst, src, (size_t)n * 4); break;
        case FT_FMT_BF16:
            for (uint32_t i = 0; i < n; ++i) dst[i] = bf16_to_float(((const uint16_t*)src)[i]);
            break;
        default:
            for (uint32_t i = 0; i < n; ++i) dst[i] = half_to_float(((const uint16_t*)src)[i]);
            break;
    }
}

inline void save(uint32_t fmt, void* dst, const float* src, uint32_t n) {
    switch (fmt) {
        case FT_FMT_F32: std::memcpy(dst, src, (size_t)n * 4); break;
        case FT_FMT_BF16:
            for (uint32_t i = 0; i < n; ++i) ((uint16_t*)dst)[i] = float_to_bf16(src[i]);
            break;
        default:
            for (uint32_t i = 0; i < n; ++i) ((uint16_t*)dst)[i] = float_to_half(src[i]);
            break;
    }
}

// x[i] = the value it takes once stored in fmt
inline void round_to(uint32_t fmt, float* x, uint32_t n) {
    if (fmt == FT_FMT_BF16)
        for (uint32_t i = 0; i < n; ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
    else if (fmt == FT_FMT_F16)
        for (uint32_t i = 0; i < n; ++i) x[i] = half_to_float(float_to_half(x[i]));
}

}  // namespace act_rows
}  // namespace ft
