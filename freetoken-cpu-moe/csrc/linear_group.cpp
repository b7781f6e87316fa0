#include "linear_group.h"

#include <algorithm>
#include <stdexcept>
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

struct Piece {
    uint32_t w, r0, r1;
};

}  // namespace

void linear_group(const ft_weight_desc* const* ws, uint32_t n, const void* x, uint32_t x_fmt, uint32_t T, void* y,
                  uint32_t y_fmt, uint64_t y_stride, const uint64_t* col, Pool& pool, const KernelTable& k) {
    FlushDenormalsScope ftz;
    if (!n || !ws || !col) throw BadTask("linear_group: no matrices");
    if (!is_act(x_fmt) || !is_act(y_fmt)) throw BadTask("linear_group: activations must be f32, f16 or bf16");
    if (T == 0) return;
    if (!x || !y) throw BadTask("linear_group: null buffer");
    const uint32_t C = ws[0] ? ws[0]->cols : 0;
    for (uint32_t i = 0; i < n; ++i) {
        if (!ws[i]) throw BadTask("linear_group: null weight descriptor");
        validate_weight(*ws[i], "linear_group weights");
        if (ws[i]->cols != C)
            throw BadTask("linear_group: matrix " + std::to_string(i) + " has " + std::to_string(ws[i]->cols) +
                          " columns, the first has " + std::to_string(C));
        if (col[i] + ws[i]->rows > y_stride)
            throw BadTask("linear_group: matrix " + std::to_string(i) + " does not fit the output row");
    }
    // the input as float32, then once per activation kind the matrices need
    thread_local std::vector<float> xf;
    thread_local std::vector<uint8_t> prepared[3];
    xf.resize((size_t)T * C);
    for (size_t i = 0; i < (size_t)T * C; ++i) xf[i] = load_one(x_fmt, x, i);
    std::vector<const void*> xs[3];
    for (uint32_t i = 0; i < n; ++i) {
        const ActKind kind = act_kind_for(ws[i]->format);
        if (!xs[kind].empty()) continue;
        xs[kind].resize(T);
        const size_t bytes = act_bytes(kind, C);
        if (kind != ACT_F32) prepared[kind].resize((size_t)T * bytes + 64);
        uint8_t* base = kind == ACT_F32 ? nullptr
                                        : (uint8_t*)(((uintptr_t)prepared[kind].data() + 63) & ~(uintptr_t)63);
        for (uint32_t t = 0; t < T; ++t) {
            if (kind == ACT_F32) {
                xs[kind][t] = xf.data() + (size_t)t * C;
            } else {
                k.prepare(kind, xf.data() + (size_t)t * C, C, base + (size_t)t * bytes);
                xs[kind][t] = base + (size_t)t * bytes;
            }
        }
    }
    // pieces of 16-row multiples, ~8 per worker over all the rows
    uint64_t rows = 0;
    for (uint32_t i = 0; i < n; ++i) rows += ws[i]->rows;
    const uint32_t nth = (uint32_t)pool.num_threads();
    const uint32_t chunk = (uint32_t)std::max<uint64_t>(16, ((rows + 8ull * nth - 1) / (8ull * nth) + 15) & ~15ull);
    std::vector<Piece> pieces;
    for (uint32_t i = 0; i < n; ++i)
        for (uint32_t r = 0; r < ws[i]->rows; r += chunk) pieces.push_back({i, r, std::min(ws[i]->rows, r + chunk)});
    pool.parallel_for((int)pieces.size(), [&](int it, int) {
        const Piece& p = pieces[(size_t)it];
        const ft_weight_desc& w = *ws[p.w];
        const uint32_t nr = p.r1 - p.r0;
        thread_local std::vector<float> acc;
        acc.resize((size_t)T * nr);
        k.dot_rows(w, 0, p.r0, p.r1, xs[act_kind_for(w.format)].data(), T, acc.data(), nr);
        for (uint32_t t = 0; t < T; ++t)
            for (uint32_t r = 0; r < nr; ++r)
                store_one(y_fmt, y, (size_t)t * y_stride + col[p.w] + p.r0 + r, acc[(size_t)t * nr + r]);
    });
}

}  // namespace ft
