// Several projections of the same input (the q, k and v of a layer, whatever their
// formats) in one wake-up of the pool: the input is prepared once per activation kind,
// and the row pieces of every matrix are handed out from one list. For few tokens (decode);
// the caller runs many-token calls through linear_forward (its matrix path splits tokens).
#pragma once

#include <cstdint>

#include "common.h"
#include "pool.h"

namespace ft {

// y[t][col[i] + r] = (W_i x[t])[r] for every matrix i (one-expert descriptors, the same cols);
// x [T][cols] in x_fmt, y rows of y_stride elements in y_fmt (f32, f16, bf16).
void linear_group(const ft_weight_desc* const* ws, uint32_t n, const void* x, uint32_t x_fmt, uint32_t T, void* y,
                  uint32_t y_fmt, uint64_t y_stride, const uint64_t* col, Pool& pool, const KernelTable& k);

}  // namespace ft
