// One MoE layer (and dense projections) on the CPU: routing, grouping tokens
// by expert, gate/up -> activation -> down, weighted sum into y.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "common.h"
#include "pool.h"

namespace ft {

// A descriptor or argument that fails validation (mapped to Python ValueError).
struct BadTask : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

struct MoeCall {
    const ft_expert_bank* bank = nullptr;
    const void* x = nullptr;   // [T][hidden] in x_fmt
    uint32_t x_fmt = FT_FMT_F32;
    const int32_t* ids = nullptr;  // [T][K]
    const float* w = nullptr;      // [T][K]
    uint32_t T = 0, K = 0;
    void* y = nullptr;             // [T][hidden] in y_fmt
    uint32_t y_fmt = FT_FMT_F32;
    bool accumulate = false;
};

void validate_weight(const ft_weight_desc& w, const char* name);
void validate_bank(const ft_expert_bank& b);
void moe_forward(const MoeCall& call, Pool& pool, const KernelTable& k);
// y[T][rows] = x[T][cols] @ W[0]^T. With argmax (and not accumulate): argmax[t] = the first
// position of the largest value of y's row t as y_fmt holds it (row_argmax.h: numpy's argmax),
// each worker reducing the rows it computed while they are in its cache; y may then be null
// (the values are not stored).
void linear_forward(const ft_weight_desc& w, const void* x, uint32_t x_fmt, uint32_t T, void* y,
                    uint32_t y_fmt, bool accumulate, Pool& pool, const KernelTable& k, int64_t* argmax = nullptr);
// Run the ft_task_desc at desc (validates it; throws BadTask).
void run_task(const ft_task_desc* desc, Pool& pool, const KernelTable& k);

}  // namespace ft
