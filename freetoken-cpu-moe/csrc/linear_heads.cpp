#include "linear_heads.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fp_env.h"
#include "moe.h"

namespace ft {
namespace {

bool is_act(uint32_t f) { return f == FT_FMT_F32 || f == FT_FMT_F16 || f == FT_FMT_BF16; }

// dst[0..n) as float32 from src (format fmt)
void load_row(uint32_t fmt, const void* src, float* dst, uint32_t n) {
    if (fmt == FT_FMT_F32) {
        std::memcpy(dst, src, (size_t)n * 4);
        return;
    }
    const uint16_t* s = (const uint16_t*)src;
    if (fmt == FT_FMT_BF16)
        for (uint32_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
    else
        for (uint32_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
}

// dst[0..n) (format fmt) = src
void store_row(uint32_t fmt, void* dst, const float* src, uint32_t n) {
    if (fmt == FT_FMT_F32) {
        std::memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t* d = (uint16_t*)dst;
    if (fmt == FT_FMT_BF16)
        for (uint32_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
    else
        for (uint32_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
}

}  // namespace

void linear_heads(const ft_weight_desc& w, const void* x, uint32_t x_fmt, uint32_t T, void* y, uint32_t y_fmt,
                  Pool& pool, const KernelTable& k) {
    FlushDenormalsScope ftz;
    validate_weight(w, "linear_heads weights");
    if (!is_act(x_fmt) || !is_act(y_fmt)) throw BadTask("linear_heads: activations must be f32, f16 or bf16");
    if (T == 0) return;
    if (!x || !y) throw BadTask("linear_heads: null buffer");
    const uint32_t H = w.num_experts, R = w.rows, C = w.cols;
    const size_t n = (size_t)T * H;  // input slices, token-major: slice t * H + h
    const ActKind kind = act_kind_for(w.format);
    const size_t bytes = act_bytes(kind, C);
    const size_t xsz = x_fmt == FT_FMT_F32 ? 4 : 2, ysz = y_fmt == FT_FMT_F32 ? 4 : 2;
    thread_local std::vector<float> xf;
    thread_local std::vector<uint8_t> prepared;
    thread_local std::vector<const void*> xs;  // head-major: xs[h * T + t]
    xf.resize(n * C);
    if (kind != ACT_F32) prepared.resize(n * bytes + 64);
    uint8_t* base = kind == ACT_F32 ? nullptr : (uint8_t*)(((uintptr_t)prepared.data() + 63) & ~(uintptr_t)63);
    float* xfp = xf.data();
    xs.resize(n);
    for (uint32_t t = 0; t < T; ++t)
        for (uint32_t h = 0; h < H; ++h) {
            const size_t sl = (size_t)t * H + h;
            xs[(size_t)h * T + t] = kind == ACT_F32 ? (const void*)(xfp + sl * C) : (const void*)(base + sl * bytes);
        }
    // the input slices as float32, then prepared for the weights' format, in pieces of 64
    // slices over the pool (the workers see the caller's buffers through these pointers: a
    // thread_local name is each thread's own)
    const uint32_t kPiece = 64, pieces = (uint32_t)((n + kPiece - 1) / kPiece);
    pool.parallel_for((int)pieces, [&](int it, int) {
        const size_t s0 = (size_t)it * kPiece, s1 = std::min(n, s0 + kPiece);
        for (size_t sl = s0; sl < s1; ++sl) {
            load_row(x_fmt, (const uint8_t*)x + sl * C * xsz, xfp + sl * C, C);
            if (kind != ACT_F32) k.prepare(kind, xfp + sl * C, C, base + sl * bytes);
        }
    });
    // one item per head (each reads its own matrix once for all tokens)
    const void* const* heads_x = xs.data();
    pool.parallel_for((int)H, [&](int h, int) {
        thread_local std::vector<float> acc;
        acc.resize((size_t)T * R);
        k.dot_rows(w, (uint32_t)h, 0, R, heads_x + (size_t)h * T, T, acc.data(), R);
        for (uint32_t t = 0; t < T; ++t)
            store_row(y_fmt, (uint8_t*)y + ((size_t)t * H + h) * R * ysz, acc.data() + (size_t)t * R, R);
    });
}

}  // namespace ft
