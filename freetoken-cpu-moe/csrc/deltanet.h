// One decode token of a Gated DeltaNet linear-attention layer (Qwen3-Next, Qwen3.5) between
// its input and output projections, as one native call: the gates, the short causal
// convolution with its window update, q/k L2 normalisation, the gated delta rule on the
// [value_heads][key_dim][value_dim] state (updated in place) and the gated RMSNorm.
// freetoken.models.gated_deltanet has the math; its torch form (DenseOps.deltanet_decode)
// is the reference this is tested against. Float32 inside; the state is float32.
#pragma once

#include <cstdint>

#include "common.h"
#include "pool.h"

namespace ft {

struct DeltaNetDecodeCall {
    // the input projection's outputs of each token (rows strided by *_tok elements, unit
    // stride inside): the conv channels [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)], the output gate
    // z [Hv*dv] and the per-value-head b (beta logit) and a (decay input) [Hv]
    const void* mixed = nullptr;
    const void* z = nullptr;
    const void* b = nullptr;
    const void* a = nullptr;
    uint64_t mixed_tok = 0, z_tok = 0, b_tok = 0, a_tok = 0;
    uint32_t fmt = FT_FMT_F32;  // of mixed, z, b, a and out
    uint32_t T = 0;
    uint32_t key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0, conv_kernel = 0;
    bool tiled = false;  // value head j uses key head j % key_heads (else j / (value_heads / key_heads))
    const void* conv_w = nullptr;  // [channels][conv_kernel]
    uint32_t conv_w_fmt = FT_FMT_F32;
    const float* A = nullptr;        // [Hv], -exp(A_log)
    const float* dt_bias = nullptr;  // [Hv]
    const void* norm_w = nullptr;    // [value_dim]
    uint32_t norm_fmt = FT_FMT_F32;
    float eps = 1e-6f;
    // per-request state, row slots[t] of token t (distinct slots)
    const int64_t* slots = nullptr;
    uint64_t num_slots = 0;
    void* conv_state = nullptr;  // [num_slots][conv_kernel - 1][channels] in conv_fmt
    uint32_t conv_fmt = FT_FMT_F32;
    float* ssm_state = nullptr;  // [num_slots][Hv][key_dim][value_dim]
    void* out = nullptr;         // [T][Hv * value_dim] contiguous in fmt
};

// Validates the call (std::invalid_argument naming the problem) and runs it; the value
// heads of the tokens are shared out across the pool.
void deltanet_decode(const DeltaNetDecodeCall& c, Pool& pool);

}  // namespace ft
