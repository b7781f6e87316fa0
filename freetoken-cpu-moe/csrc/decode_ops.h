// The small per-token operations of a decoder layer around its matmuls, fused into one
// native call each (the CPU backend's DenseOps): residual add + RMSNorm; per-head q/k
// RMSNorm + NeoX RoPE + the K/V cache write; the router's top-k. They run on the calling
// thread: a decode step's vectors are a few thousand elements, below the cost of waking
// the pool. Everything computes in float32 and rounds once to the output format.
#pragma once

#include <cstdint>

#include "common.h"

namespace ft {

// h_out[t] = h[t] + delta[t] (delta may be null; h_out may be h), x_out[t] = w * rmsnorm(h_out[t]).
// Activations [T][n] contiguous in fmt (f32, f16, bf16); w [n] in w_fmt.
void add_rms_norm(const void* h, const void* delta, const void* w, uint32_t w_fmt, void* h_out, void* x_out,
                  uint32_t fmt, uint32_t T, uint32_t n, float eps);

struct QkRopeCall {
    // q [T][Hq * D], k and v [T][Hkv * D] (rows strided by *_tok elements, unit stride inside)
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    uint64_t q_tok = 0, k_tok = 0, v_tok = 0;
    uint32_t fmt = FT_FMT_F32;
    uint32_t T = 0, Hq = 0, Hkv = 0, D = 0;
    const void* q_w = nullptr;  // [D] per-head RMSNorm weights (null: no norm)
    const void* k_w = nullptr;
    uint32_t w_fmt = FT_FMT_F32;
    // float32 projection biases [Hq * D], [Hkv * D], [Hkv * D] (null: none), added first and
    // rounded to fmt, as the sum of a biased projection is stored
    const float* q_b = nullptr;
    const float* k_b = nullptr;
    const float* v_b = nullptr;
    float eps = 1e-6f;
    const float* cos = nullptr;         // [max_pos][D]
    const float* sin_signed = nullptr;  // [max_pos][D], sin with rotate-half's sign folded in
    uint32_t max_pos = 0;
    const int64_t* positions = nullptr;  // [T]
    const int64_t* slots = nullptr;      // [T] cache slot of each token (block * block_size + offset)
    void* k_cache = nullptr;             // [num_slots][Hkv][D] in kv_fmt
    void* v_cache = nullptr;
    uint32_t kv_fmt = FT_FMT_F32;
    uint64_t num_slots = 0;
    void* q_out = nullptr;  // [T][Hq][D] contiguous in fmt
};

// q_out = rope(norm(q + q_b)); k_cache[slot] = rope(norm(k + k_b)); v_cache[slot] = v + v_b.
void qk_norm_rope_store(const QkRopeCall& c);

// Top-k of logits [T][E] (float32): ids [T][k] (descending logits, the lower id first on
// ties), w [T][k] float32: softmax over the k logits when norm, else their probabilities
// under the softmax over all E.
void router_top_k(const float* logits, uint32_t T, uint32_t E, uint32_t k, bool norm, int32_t* ids, float* w);

// The routed experts' down-projection biases: out[t] = y[t][:H] + sum_k w[t][k] * bias[ids[t][k]]
// (routes with ids < 0 skipped), in float32, rounded once to fmt. y: [T] rows of y_tok
// elements (>= H) in fmt; out: [T][H] contiguous in fmt (may be y when y_tok == H); bias:
// float32 [E][H]; ids int32 and w float32 [T][K].
void moe_bias_add(const void* y, uint64_t y_tok, uint32_t fmt, uint32_t T, uint32_t H, const int32_t* ids,
                  const float* w, uint32_t K, const float* bias, uint32_t E, void* out);

}  // namespace ft
