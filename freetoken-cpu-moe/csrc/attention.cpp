#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp_env.h"

namespace ft {
namespace {

// Queries x heads of one item: bounds its scratch (queries, states) to a few tens of KB.
constexpr uint32_t kMaxVectors = 64;
// A piece of a context shorter than this is not split further.
constexpr uint32_t kMinSplitKeys = 64;

struct Item {
    uint32_t seq, kvh, i0, nq, p0, p1, slot;  // slot: the item's index in the partial buffer
};

bool is_act(uint32_t f) { return f == FT_FMT_F32 || f == FT_FMT_F16 || f == FT_FMT_BF16; }

void store(uint32_t fmt, void* dst, size_t idx, float v) {
    switch (fmt) {
        case FT_FMT_F32: ((float*)dst)[idx] = v; break;
        case FT_FMT_BF16: ((uint16_t*)dst)[idx] = float_to_bf16(v); break;
        default: ((uint16_t*)dst)[idx] = float_to_half(v); break;
    }
}

const AttnKernels& kernels_for(const KernelTable& k) {
    const std::string name(k.name);
    if (name == "amx" || name == "avx512") return *attn_kernels_avx512();
    if (name == "avx2" || name == "avx_vnni") return *attn_kernels_avx2();
    return *attn_kernels_scalar();
}

void validate(const AttnCall& c) {
    auto bad = [](const std::string& why) { throw std::invalid_argument("paged_attention: " + why); };
    if (!c.q || !c.k_cache || !c.v_cache || !c.out) bad("null q, k_cache, v_cache or out");
    if (!is_act(c.q_fmt) || !is_act(c.kv_fmt) || !is_act(c.out_fmt)) bad("q, KV and out must be f32, f16 or bf16");
    if (!c.num_blocks || !c.block_size || !c.num_kv_heads || !c.head_dim || !c.num_heads) bad("empty cache shape");
    if (c.num_heads % c.num_kv_heads)
        bad(std::to_string(c.num_heads) + " query heads are not a multiple of " + std::to_string(c.num_kv_heads) +
            " kv heads");
    if (c.num_seqs && (!c.q_start || !c.q_len || !c.ctx_len || !c.block_table)) bad("null sequence arrays");
    if (!(c.scale > 0.0f) || !std::isfinite(c.scale)) bad("scale must be a positive number");
    for (uint32_t s = 0; s < c.num_seqs; ++s) {
        const int64_t qs = c.q_start[s], ql = c.q_len[s], ctx = c.ctx_len[s];
        const std::string who = "sequence " + std::to_string(s) + ": ";
        if (qs < 0 || ql < 0 || qs + ql > (int64_t)c.num_tokens)
            bad(who + "queries [" + std::to_string(qs) + ", " + std::to_string(qs + ql) + ") outside the step's " +
                std::to_string(c.num_tokens) + " tokens");
        if (ctx < ql) bad(who + "context " + std::to_string(ctx) + " shorter than its " + std::to_string(ql) + " queries");
        const int64_t nblk = (ctx + c.block_size - 1) / c.block_size;
        if (nblk > (int64_t)c.bt_stride)
            bad(who + "context " + std::to_string(ctx) + " needs " + std::to_string(nblk) + " blocks, the table has " +
                std::to_string(c.bt_stride));
        const int32_t* bt = c.block_table + (size_t)s * c.bt_stride;
        for (int64_t b = 0; b < nblk; ++b)
            if (bt[b] < 0 || (uint32_t)bt[b] >= c.num_blocks)
                bad(who + "block id " + std::to_string(bt[b]) + " out of range [0, " + std::to_string(c.num_blocks) + ")");
    }
}

}  // namespace

void paged_attention(const AttnCall& c, Pool& pool, const KernelTable& k) {
    FlushDenormalsScope ftz;
    validate(c);
    const AttnKernels& kern = kernels_for(k);
    const uint32_t D = c.head_dim, g = c.num_heads / c.num_kv_heads, Hq = c.num_heads;
    const uint32_t QB = std::max(1u, kMaxVectors / g);  // queries per item
    const int nth = pool.num_threads();

    // ---- items: (sequence, kv head, block of queries), each over the keys its queries see
    std::vector<Item> items;
    for (uint32_t s = 0; s < c.num_seqs; ++s) {
        const uint32_t ql = (uint32_t)c.q_len[s], ctx = (uint32_t)c.ctx_len[s];
        for (uint32_t h = 0; h < c.num_kv_heads; ++h)
            for (uint32_t i0 = 0; i0 < ql; i0 += QB) {
                const uint32_t nq = std::min(QB, ql - i0);
                const uint32_t first = ctx - ql + i0, last = first + nq - 1;  // positions of its queries
                const uint32_t lo = (c.window && first + 1 > c.window) ? first + 1 - c.window : 0;
                items.push_back({s, h, i0, nq, lo, last + 1, 0});
            }
    }
    // ---- few items (decode): split each context into pieces merged afterwards
    uint32_t nsplit = 1;
    const uint32_t want = 4u * (uint32_t)nth;
    if (nth > 1 && !items.empty() && items.size() < want) {
        uint32_t longest = 0;
        for (const Item& it : items) longest = std::max(longest, it.p1 - it.p0);
        nsplit = std::min<uint32_t>((want + (uint32_t)items.size() - 1) / (uint32_t)items.size(),
                                    std::max(1u, longest / kMinSplitKeys));
    }
    if (nsplit > 1) {
        std::vector<Item> split;
        split.reserve(items.size() * nsplit);
        for (uint32_t q = 0; q < items.size(); ++q) {
            const Item& it = items[q];
            const uint32_t len = it.p1 - it.p0, piece = (len + nsplit - 1) / nsplit;
            for (uint32_t sp = 0; sp < nsplit; ++sp) {
                const uint32_t a = std::min(it.p1, it.p0 + sp * piece), b = std::min(it.p1, a + piece);
                split.push_back({it.seq, it.kvh, it.i0, it.nq, a, b, q * nsplit + sp});
            }
        }
        items.swap(split);
    }
    // the longest pieces first (causal prompts: the last queries see the most keys)
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& a, const Item& b) { return a.p1 - a.p0 > b.p1 - b.p0; });

    // token -> (sequence, index in it); rows no sequence owns are zero
    std::vector<int32_t> tok_seq(c.num_tokens, -1);
    for (uint32_t s = 0; s < c.num_seqs; ++s)
        for (int32_t i = 0; i < c.q_len[s]; ++i) tok_seq[(size_t)c.q_start[s] + i] = (int32_t)s;
    const size_t osz = c.out_fmt == FT_FMT_F32 ? 4 : 2, row = (size_t)Hq * D;
    for (uint32_t t = 0; t < c.num_tokens; ++t)
        if (tok_seq[t] < 0) std::memset((uint8_t*)c.out + t * row * osz, 0, row * osz);

    // finishes one (token, head): out = acc / (l + exp(sink - m)) over the merged state
    auto finish = [&](uint32_t tok, uint32_t head, float m, float l, const float* acc) {
        if (c.sinks) {
            const float sk = c.sinks[head];
            if (sk > m) {  // rescale to the sink's logit
                const float a = m > -std::numeric_limits<float>::infinity() ? std::exp(m - sk) : 0.0f;
                l = l * a + 1.0f;
                const float inv = l > 0.0f ? a / l : 0.0f;
                for (uint32_t d = 0; d < D; ++d) store(c.out_fmt, c.out, tok * row + (size_t)head * D + d, acc[d] * inv);
                return;
            }
            l += std::exp(sk - m);
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (uint32_t d = 0; d < D; ++d) store(c.out_fmt, c.out, tok * row + (size_t)head * D + d, acc[d] * inv);
    };

    uint32_t most = 1;  // queries of the largest item
    for (const Item& it : items) most = std::max(most, it.nq);
    const uint32_t Gmax = most * g;
    const size_t state = (size_t)Gmax * (D + 2);  // per item: m[G], l[G], acc[G][D]
    // the pieces' states; every slot is written before it is read (no clearing). The caller's
    // thread owns the buffer: the workers see it through the pointer.
    thread_local std::vector<float> parts_buf;
    if (nsplit > 1 && parts_buf.size() < items.size() * state) parts_buf.resize(items.size() * state);
    float* const parts = parts_buf.data();
    auto run_item = [&](int idx, int) {
        const Item& it = items[(size_t)idx];
        thread_local std::vector<float> local;
        float* st;
        if (nsplit > 1) {
            st = parts + (size_t)it.slot * state;
        } else {
            local.resize(state);
            st = local.data();
        }
        float* m = st;
        float* l = st + Gmax;
        float* acc = st + 2 * Gmax;
        kern.partial(c, it.seq, it.kvh, it.i0, it.nq, it.p0, it.p1, m, l, acc);
        if (nsplit > 1) return;
        const uint32_t tok0 = (uint32_t)c.q_start[it.seq] + it.i0;
        for (uint32_t v = 0; v < it.nq * g; ++v)
            finish(tok0 + v / g, it.kvh * g + v % g, m[v], l[v], acc + (size_t)v * D);
    };
    if (nsplit == 1) {
        pool.parallel_for((int)items.size(), run_item);
        return;
    }
    // ---- merge: one item per (token, head) of a sequence
    std::vector<Pool::Phase> phases(2);
    phases[0].nitems = (int)items.size();
    phases[0].fn = run_item;
    phases[1].nitems = (int)(c.num_tokens * Hq);
    phases[1].fn = [&](int idx, int) {
        const uint32_t tok = (uint32_t)idx / Hq, head = (uint32_t)idx % Hq;
        const int32_t s = tok_seq[tok];
        if (s < 0) return;
        const uint32_t i = tok - (uint32_t)c.q_start[s], kvh = head / g, v = (i % QB) * g + head % g;
        // the pieces of item (s, kvh, i / QB): slots q * nsplit + sp, q in creation order
        uint32_t q = 0;
        for (int32_t r = 0; r < s; ++r) q += c.num_kv_heads * (((uint32_t)c.q_len[r] + QB - 1) / QB);
        q += kvh * (((uint32_t)c.q_len[s] + QB - 1) / QB) + i / QB;
        float mx = -std::numeric_limits<float>::infinity();
        for (uint32_t sp = 0; sp < nsplit; ++sp) mx = std::max(mx, parts[(size_t)(q * nsplit + sp) * state + v]);
        thread_local std::vector<float> accm;
        accm.assign(D, 0.0f);
        float lsum = 0.0f;
        if (mx > -std::numeric_limits<float>::infinity())
            for (uint32_t sp = 0; sp < nsplit; ++sp) {
                const float* st = parts + (size_t)(q * nsplit + sp) * state;
                if (!(st[v] > -std::numeric_limits<float>::infinity())) continue;
                const float a = std::exp(st[v] - mx);
                lsum += a * st[Gmax + v];
                const float* ac = st + 2 * Gmax + (size_t)v * D;
                for (uint32_t d = 0; d < D; ++d) accm[d] += a * ac[d];
            }
        finish(tok, head, mx, lsum, accm.data());
    };
    pool.run_phases(phases);
}

}  // namespace ft
