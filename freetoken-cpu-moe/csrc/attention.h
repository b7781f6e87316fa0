// Causal attention over a paged KV cache on the worker pool (the CPU backend's decode and
// prompt attention). Layout of the cache: K and V [num_blocks][block_size][kv_heads][head_dim]
// (freetoken.engine.kv_cache); a sequence's context position p lives in block
// block_table[p / block_size], slot p % block_size.
#pragma once

#include <cstdint>

#include "common.h"
#include "pool.h"

namespace ft {

struct AttnCall {
    // queries [T][num_heads][head_dim] (element strides q_tok, q_head; unit stride in a head)
    const void* q = nullptr;
    uint32_t q_fmt = FT_FMT_F32;
    uint64_t q_tok = 0, q_head = 0;
    const void* k_cache = nullptr;
    const void* v_cache = nullptr;
    uint32_t kv_fmt = FT_FMT_F32;
    uint32_t num_blocks = 0, block_size = 0, num_kv_heads = 0, head_dim = 0, num_heads = 0;
    // sequences: their queries are tokens [q_start, q_start + q_len) of the step; ctx_len is
    // the context after this step (it already holds the step's K/V); the query i of a sequence
    // sits at position ctx_len - q_len + i and sees positions <= its own
    uint32_t num_seqs = 0;
    const int32_t* q_start = nullptr;
    const int32_t* q_len = nullptr;
    const int32_t* ctx_len = nullptr;
    const int32_t* block_table = nullptr;  // [num_seqs][bt_stride]
    uint32_t bt_stride = 0;
    uint32_t num_tokens = 0;  // T
    void* out = nullptr;      // [T][num_heads * head_dim], contiguous
    uint32_t out_fmt = FT_FMT_F32;
    float scale = 1.0f;
    uint32_t window = 0;           // > 0: a query at p sees p - window < j <= p
    const float* sinks = nullptr;  // [num_heads] extra softmax logits whose value row is zero
};

// Per-tier compute, in attention_<tier>.cpp (one translation unit per ISA tier).
struct AttnKernels {
    // Online softmax of `nq` queries (tokens i0..i0+nq of a sequence, every head of kv head
    // `kvh`) over context positions [p0, p1): writes the unnormalised partial state of each
    // (query, head): m (running max, -inf if no key), l (sum of exp), acc[head_dim].
    void (*partial)(const AttnCall& c, uint32_t seq, uint32_t kvh, uint32_t i0, uint32_t nq, uint32_t p0,
                    uint32_t p1, float* m, float* l, float* acc);
};

const AttnKernels* attn_kernels_scalar();
const AttnKernels* attn_kernels_avx2();
const AttnKernels* attn_kernels_avx512();

// Validates the call (throws std::invalid_argument naming the problem) and runs it:
// items (sequence, kv head, block of queries, piece of the context) handed out across the
// pool, then one merge of each query head's pieces. Tier from the kernel table's name.
void paged_attention(const AttnCall& c, Pool& pool, const KernelTable& k);

}  // namespace ft
