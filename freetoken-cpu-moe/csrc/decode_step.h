// A whole decode step of a Qwen3-MoE-shaped model in one native call: per layer a
// pre-norm GQA attention block (residual add + RMSNorm, fused q/k/v, per-head q/k RMSNorm +
// NeoX RoPE + the K/V cache write, paged attention, o) and a routed-experts block (residual
// add + RMSNorm, float32 router, top-k, experts), then the final norm. It calls the native ops
// the CPU backend's per-op path calls one by one (add_rms_norm, linear_group,
// qk_norm_rope_store, paged_attention, linear_forward, router_top_k, moe_forward) in the same
// order on the same values, so its result is bit-identical to that path; what it removes is
// the Python and torch glue between them (allocations, checks, argument conversion), which a
// decode step pays with caches the weight stream has just flushed.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "pool.h"

namespace ft {

struct DecodeLayer {
    const void* in_norm = nullptr;    // [H] in DecodeModel::norm_fmt
    const void* post_norm = nullptr;  // [H]
    std::vector<const ft_weight_desc*> qkv;  // one-expert matrices whose rows stack to q, k, v
    std::vector<uint64_t> qkv_col;           // first output column of each
    const void* q_norm = nullptr;            // [D]
    const void* k_norm = nullptr;            // [D]
    const ft_weight_desc* o = nullptr;       // [H][Hq * D]
    const ft_weight_desc* router = nullptr;  // [E][H], float32 logits
    const ft_expert_bank* bank = nullptr;    // E experts of hidden H
    void* k_cache = nullptr;                 // [num_blocks][block_size][Hkv][D] in kv_fmt
    void* v_cache = nullptr;
};

struct DecodeModel {
    uint32_t fmt = FT_FMT_F32;       // activations (f32, f16, bf16)
    uint32_t norm_fmt = FT_FMT_F32;  // every RMSNorm weight
    uint32_t kv_fmt = FT_FMT_F32;
    uint32_t H = 0, Hq = 0, Hkv = 0, D = 0, E = 0, K = 0;
    bool norm_topk = false;
    float eps = 1e-6f;
    float scale = 1.0f;  // attention softmax scale
    const void* final_norm = nullptr;
    const float* cos = nullptr;         // [max_pos][D]
    const float* sin_signed = nullptr;  // [max_pos][D]
    uint32_t max_pos = 0;
    uint32_t num_blocks = 0, block_size = 0;
    std::vector<DecodeLayer> layers;
};

// One step's inputs: T tokens of num_seqs sequences (AttnCall's tables).
struct DecodeStepIO {
    uint32_t T = 0;
    const void* embed = nullptr;  // [T][H] in fmt: the tokens' embeddings
    const int64_t* positions = nullptr;
    const int64_t* slots = nullptr;
    uint32_t num_seqs = 0;
    const int32_t* q_start = nullptr;
    const int32_t* q_len = nullptr;
    const int32_t* ctx_len = nullptr;
    const int32_t* block_table = nullptr;
    uint32_t bt_stride = 0;
    void* out = nullptr;  // [T][H] in fmt: the final-normed hidden states
};

// Parts a profiled step's time is split into (wall time of the calls on this thread).
enum DecodePart : int { kPartQkv, kPartAttention, kPartOProj, kPartRouter, kPartExperts, kPartOther, kNumParts };

class DecodeStep {
public:
    // Validates the model's shapes and descriptors (throws std::invalid_argument naming the layer).
    explicit DecodeStep(DecodeModel m);
    void run(const DecodeStepIO& io, Pool& pool, const KernelTable& k);
    const DecodeModel& model() const { return m_; }

    bool profile = false;           // accumulate part_ns while set
    uint64_t part_ns[kNumParts] = {};
    uint64_t steps = 0;             // steps run while profiling

private:
    DecodeModel m_;
    std::vector<uint8_t> ws_;  // per-step scratch, grown to the largest T seen
};

}  // namespace ft
