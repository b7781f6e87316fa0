// One small matrix per attention head applied to that head's slice of the input (the
// absorbed up-projections of multi-head latent attention: a query head into latent space,
// a latent output back to a head's values), every head in one wake-up of the pool.
#pragma once

#include <cstdint>

#include "common.h"
#include "pool.h"

namespace ft {

// y[t][h][r] = (W[h] x[t][h])[r] for h < w.num_experts (one head per expert of the
// descriptor), r < w.rows; x [T][heads][w.cols] in x_fmt, y [T][heads][w.rows] in y_fmt
// (f32, f16, bf16), both contiguous.
void linear_heads(const ft_weight_desc& w, const void* x, uint32_t x_fmt, uint32_t T, void* y, uint32_t y_fmt,
                  Pool& pool, const KernelTable& k);

}  // namespace ft
