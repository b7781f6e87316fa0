#include "linear_heads.h"

#include <algorithm>
#include <string>
#include <vector>

#include "fp_env.h"
#include "moe.h"

namespace ft {
namespace {

bool is_act(uint32_t f) { return f == FT_FMT_F32 || f == FT_FMT_F16 || f == FT_FMT_BF16; }

float load_one(uint32_t fmt, const void* p, size_t i) {
    switch (fmt) {
        case FT_FMT_F32: return ((const float*)p)[i];
        case FT_FMT_BF16: return bf16_to_float(((const uint16_t*)p)[i]);
        default: return half_to_float(((const uint16_t*)p)[i]);
    }
}

void store_one(uint32_t fmt, void* p, size_t i, float v) {
    switch (fmt) {
        case FT_FMT_F32: ((float*)p)[i] = v; break;
        case FT_FMT_BF16: ((uint16_t*)p)[i] = float_to_bf16(v); break;
        default: ((uint16_t*)p)[i] = float_to_half(v); break;
    }
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
    thread_local std::vector<float> xf;
    thread_local std::vector<uint8_t> prepared;
    thread_local std::vector<const void*> xs;  // head-major: xs[h * T + t]
    xf.resize(n * C);
    for (size_t i = 0; i < n * C; ++i) xf[i] = load_one(x_fmt, x, i);
    if (kind != ACT_F32) prepared.resize(n * bytes + 64);
    uint8_t* base = kind == ACT_F32 ? nullptr : (uint8_t*)(((uintptr_t)prepared.data() + 63) & ~(uintptr_t)63);
    xs.resize(n);
    for (uint32_t t = 0; t < T; ++t)
        for (uint32_t h = 0; h < H; ++h) {
            const size_t s = (size_t)t * H + h;
            if (kind == ACT_F32) {
                xs[(size_t)h * T + t] = xf.data() + s * C;
            } else {
                k.prepare(kind, xf.data() + s * C, C, base + s * bytes);
                xs[(size_t)h * T + t] = base + s * bytes;
            }
        }
    // one item per head (each reads its own matrix once for all tokens); the workers see the
    // caller's buffers through these pointers (a thread_local name is each thread's own)
    const void* const* heads_x = xs.data();
    pool.parallel_for((int)H, [&](int h, int) {
        thread_local std::vector<float> acc;
        acc.resize((size_t)T * R);
        k.dot_rows(w, (uint32_t)h, 0, R, heads_x + (size_t)h * T, T, acc.data(), R);
        for (uint32_t t = 0; t < T; ++t)
            for (uint32_t r = 0; r < R; ++r)
                store_one(y_fmt, y, ((size_t)t * H + h) * R + r, acc[(size_t)t * R + r]);
    });
}

}  // namespace ft
