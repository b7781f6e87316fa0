/*
 * A few tokens through their routed experts, the experts kept as a GGUF file's Q4_K, Q6_K,
 * Q8_0 or MXFP4 blocks (gate and up [E, I, H], down [E, H, I]; gate and up both of 32-value
 * blocks or both K-quants): decode's mixture of experts in two launches built from
 * packed_gemv.cuh's pieces (the same int8 quantization of activations, the same per-lane
 * block items and dp4a products).
 *
 *   gate/up  grid (T * K routes, I / 32): route r = (t, k) runs expert e = ids[t, k] (through
 *            the slot table when one is given; -1: skipped, nothing written). The block
 *            quantizes x_t into shared memory; each of its 8 warps takes four of the block's
 *            32 intermediate rows, two at a time, the gate and up rows' items over its lanes
 *            (four dots in flight); h = act(gate, up): silu(gate) * up, or GPT-OSS's clamped
 *            SwiGLU (MOE_ACT_SWIGLU_OAI). The block then quantizes its 32 values
 *            of h as one group (codes hq [T*K, I], scale hd [T*K, I/32], 16-value code sums
 *            hs [T*K, I/16]), which is what the down kernel multiplies.
 *   down     grid (H / 8, T): the block copies token t's K routes' quantized h, experts and
 *            weights into shared memory; a warp per output row n spreads the items of all K
 *            routes' rows (K * I / 64 of them) over its lanes, each times its route's weight,
 *            and sums once: y[t, n] = sum_k w[t, k] * (down_e[n, :] . h[t, k, :]). No atomics.
 *
 * NVIDIA only, as packed_gemv.cuh; the bindings leave it out of HIP builds.
 */
#ifndef FREETOKEN_GPU_PACKED_MOE_CUH
#define FREETOKEN_GPU_PACKED_MOE_CUH

#include <freetoken/gpu/packed_gemv.cuh>

namespace freetoken_gpu {

/* the most routes per token the down kernel keeps in shared memory */
constexpr int MOE_MAX_TOP_K = 16;
/* the down kernel's shared memory for a token's routes (the default limit of a launch) */
constexpr int64_t MOE_MAX_DOWN_SHARED = 48 * 1024;
/* gated activations (the Python side's ACT_CODES): silu(g) * u, and GPT-OSS's
 * min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1) */
constexpr int MOE_ACT_SILU = 0;
constexpr int MOE_ACT_SWIGLU_OAI = 2;

namespace moe_detail {

using gemv_detail::block_bytes;
using gemv_detail::items_of;
using gemv_detail::row_bytes_of;
using gemv_detail::quantize_from;
using gemv_detail::row_item;
using gemv_detail::store_out;
using gemv_detail::TokenValues;
using gemv_detail::warp_sum;

constexpr int kGuWarps = 8;                /* warps of a gate/up block */
constexpr int kGuThreads = kGuWarps * 32;
constexpr int kGuRows = 32;                /* intermediate rows of a block: one group of h */
constexpr int kRowsInFlight = 2;           /* rows a warp's lanes work on at once (gate and up each) */
constexpr int kDownWarps = 8;              /* warps of a down block, one output row each */
constexpr int kDownThreads = kDownWarps * 32;

/* The routes: ids [T, K] (int32 or int64), an optional slot table (int32: the ids index it,
 * its entries are the stack's experts, -1 none), the routes' weights [T, K] (w_dtype). */
struct Routes {
    const void* ids;
    int ids_64;
    const int* table;
    const void* w;
    int w_dtype;
    int top_k;
};

__device__ __forceinline__ int route_expert(const Routes& r, int route) {
    long long e = r.ids_64 ? static_cast<const long long*>(r.ids)[route] : static_cast<const int*>(r.ids)[route];
    if (e >= 0 && r.table != nullptr) e = r.table[e];
    return e < 0 ? -1 : static_cast<int>(e);
}

__device__ __forceinline__ float route_weight(const Routes& r, int route) {
    if (r.w_dtype == GEMV_F32) return static_cast<const float*>(r.w)[route];
    if (r.w_dtype == GEMV_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(r.w)[route]);
    return __half2float(static_cast<const __half*>(r.w)[route]);
}

struct Activation {
    int code;
    float alpha, limit;
};

__device__ __forceinline__ float activate(const Activation& a, float g, float u) {
    if (a.code == MOE_ACT_SWIGLU_OAI) {
        g = fminf(g, a.limit);
        u = fminf(fmaxf(u, -a.limit), a.limit);
        return g / (1.f + expf(-a.alpha * g)) * (u + 1.f);
    }
    return g / (1.f + expf(-g)) * u;
}

template <int DT>
__device__ __forceinline__ const void* token_row(const void* x, int64_t offset) {
    if (DT == GEMV_F32) return static_cast<const float*>(x) + offset;
    return static_cast<const uint16_t*>(x) + offset;
}

template <int GF, int UF, int XT>
__global__ void __launch_bounds__(kGuThreads, 2) moe_gate_up_kernel(const void* __restrict__ x, Routes routes,
                                                                 const uint8_t* __restrict__ gate,
                                                                 const uint8_t* __restrict__ up, int hidden,
                                                                 int inter, Activation act, int8_t* __restrict__ hq,
                                                                 float* __restrict__ hd, int* __restrict__ hs) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int r = blockIdx.x;
    const int e = route_expert(routes, r);
    if (e < 0) return; /* the whole block: no barrier is left waiting */
    const int t = r / routes.top_k;
    int8_t* xq = reinterpret_cast<int8_t*>(smem);
    float* xd = reinterpret_cast<float*>(smem + hidden);
    int* xs = reinterpret_cast<int*>(smem + hidden + (hidden / 32) * 4);
    float* hv = reinterpret_cast<float*>(smem + gemv_detail::shared_bytes(hidden));
    quantize_from<kGuThreads>(TokenValues<XT>{token_row<XT>(x, static_cast<int64_t>(t) * hidden)}, hidden, xq, xd,
                              xs);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i0 = blockIdx.y * kGuRows;
    static_assert(gemv_detail::block32(GF) == gemv_detail::block32(UF),
                  "gate and up: both of 32-value blocks or both K-quants (as many items)");
    const int64_t g_rb = row_bytes_of(GF, hidden);
    const int64_t u_rb = row_bytes_of(UF, hidden);
    const int items = items_of(GF, hidden);
    for (int pass = 0; pass < kGuRows / (kGuWarps * kRowsInFlight); ++pass) {
        const uint8_t* g_row[kRowsInFlight];
        const uint8_t* u_row[kRowsInFlight];
        float g[kRowsInFlight], u[kRowsInFlight];
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
            const int64_t row = static_cast<int64_t>(e) * inter + i0 + warp + (pass * kRowsInFlight + j) * kGuWarps;
            g_row[j] = gate + row * g_rb;
            u_row[j] = up + row * u_rb;
            g[j] = 0.f;
            u[j] = 0.f;
        }
        for (int it = lane; it < items; it += 32) {
#pragma unroll
            for (int j = 0; j < kRowsInFlight; ++j) {
                g[j] += row_item<GF>(g_row[j], it, xq, xd, xs);
                u[j] += row_item<UF>(u_row[j], it, xq, xd, xs);
            }
        }
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
            const float gs = warp_sum(g[j]), us = warp_sum(u[j]);
            if (lane == 0) hv[warp + (pass * kRowsInFlight + j) * kGuWarps] = activate(act, gs, us);
        }
    }
    __syncthreads();
    if (warp != 0) return;
    /* the block's 32 values of h as one int8 group, rounded as quantize_from rounds */
    const float v = hv[lane];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    const int q = static_cast<int>(floorf(__fmaf_rn(v, inv, 0.5f)));
    int sum = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o); /* within each half */
    const int64_t at = static_cast<int64_t>(r) * inter + i0;
    hq[at + lane] = static_cast<int8_t>(q);
    if ((lane & 15) == 0) hs[at / 16 + lane / 16] = sum;
    if (lane == 0) hd[at / 32] = amax * (1.0f / 127.0f);
}

inline size_t gate_up_shared_bytes(int hidden) { return gemv_detail::shared_bytes(hidden) + kGuRows * sizeof(float); }

/* a token's K routes' quantized h, then their experts and weights */
inline size_t down_shared_bytes(int64_t top_k, int64_t inter) {
    return static_cast<size_t>(top_k * inter + top_k * inter / 32 * 4 + top_k * inter / 16 * 4 +
                               MOE_MAX_TOP_K * (sizeof(int) + sizeof(float)));
}

template <int DF, int YT>
__global__ void __launch_bounds__(kDownThreads) moe_down_kernel(Routes routes, const int8_t* __restrict__ hq,
                                                                const float* __restrict__ hd,
                                                                const int* __restrict__ hs,
                                                                const uint8_t* __restrict__ down, int hidden,
                                                                int inter, void* __restrict__ y) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int k_routes = routes.top_k, t = blockIdx.y;
    const int ki = k_routes * inter;
    int8_t* sq = reinterpret_cast<int8_t*>(smem);
    float* sd = reinterpret_cast<float*>(smem + ki);
    int* ss = reinterpret_cast<int*>(smem + ki + (ki / 32) * 4);
    int* se = reinterpret_cast<int*>(smem + ki + (ki / 32) * 4 + (ki / 16) * 4);
    float* sw = reinterpret_cast<float*>(se + MOE_MAX_TOP_K);
    const int64_t first = static_cast<int64_t>(t) * ki; /* the token's first h value */
    const int4* src = reinterpret_cast<const int4*>(hq + first);
    for (int c = threadIdx.x; c < ki / 16; c += kDownThreads) reinterpret_cast<int4*>(sq)[c] = src[c];
    for (int c = threadIdx.x; c < ki / 32; c += kDownThreads) sd[c] = hd[first / 32 + c];
    for (int c = threadIdx.x; c < ki / 16; c += kDownThreads) ss[c] = hs[first / 16 + c];
    if (threadIdx.x < k_routes) {
        const int route = t * k_routes + threadIdx.x;
        const int e = route_expert(routes, route);
        se[threadIdx.x] = e;
        sw[threadIdx.x] = e >= 0 ? route_weight(routes, route) : 0.f;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * kDownWarps + warp;
    if (n >= hidden) return;
    const int64_t rb = row_bytes_of(DF, inter);
    const int items = items_of(DF, inter), total = k_routes * items;
    float acc = 0.f;
    for (int it = lane; it < total; it += 32) {
        const int k = it / items;
        const int e = se[k];
        if (e < 0) continue;
        const uint8_t* wr = down + (static_cast<int64_t>(e) * hidden + n) * rb;
        acc += sw[k] * row_item<DF>(wr, it - k * items, sq + k * inter, sd + k * (inter / 32), ss + k * (inter / 16));
    }
    acc = warp_sum(acc);
    if (lane == 0) store_out<YT>(y, t * hidden + n, acc);
}

inline bool served_format(int fmt) {
    return fmt == GEMV_Q4_K || fmt == GEMV_Q6_K || fmt == GEMV_Q8_0 || fmt == GEMV_MXFP4;
}

/* f(std::integral_constant<int, FMT>) for a served expert format (checked by the caller) */
template <class F>
void with_format(int fmt, F&& f) {
    gemv_detail::with_code<GEMV_Q4_K, GEMV_Q6_K, GEMV_Q8_0, GEMV_MXFP4>(fmt, f);
}

/* the bytes a stack's address must be a multiple of: Q4_K's 16-byte loads, Q6_K's and Q8_0's
 * 16-bit ones; MXFP4 blocks are read from aligned words whatever their address */
inline uint64_t stack_alignment(int fmt) { return fmt == GEMV_Q4_K ? 16 : fmt == GEMV_MXFP4 ? 1 : 2; }

}  // namespace moe_detail

/* The experts' formats, shapes and activation (code, MOE_ACT_*) packed_moe serves ("" if it
 * does, else why not). */
inline std::string packed_moe_refusal(int gate_fmt, int up_fmt, int down_fmt, int64_t hidden, int64_t inter,
                                      int64_t top_k, int act) {
    const char* names[3] = {"gate", "up", "down"};
    const int fmts[3] = {gate_fmt, up_fmt, down_fmt};
    for (int i = 0; i < 3; ++i)
        if (!moe_detail::served_format(fmts[i]))
            return std::string(names[i]) + " format " + std::to_string(fmts[i]) +
                   " is not Q8_0 (8), Q4_K (12), Q6_K (14) or MXFP4 (39)";
    if (gemv_detail::block32(gate_fmt) != gemv_detail::block32(up_fmt))
        return "gate format " + std::to_string(gate_fmt) + " with up format " + std::to_string(up_fmt) +
               ": gate and up are both of 32-value blocks (Q8_0, MXFP4) or both K-quants";
    if (act != MOE_ACT_SILU && act != MOE_ACT_SWIGLU_OAI)
        return "activation code " + std::to_string(act) + " (silu 0 and swiglu_oai 2 are served)";
    const int64_t hidden_block = gemv_detail::block_values(gate_fmt);
    if (hidden <= 0 || hidden % hidden_block || hidden > GEMV_MAX_COLS)
        return "hidden size " + std::to_string(hidden) + ": a multiple of " + std::to_string(hidden_block) + " up to " +
               std::to_string(GEMV_MAX_COLS) + " is needed";
    /* gate/up blocks quantize h in groups of 32 rows; a K-quant down row takes 256-value blocks */
    const int64_t inter_block = gemv_detail::block32(down_fmt) ? moe_detail::kGuRows : 256;
    if (inter <= 0 || inter % inter_block)
        return "intermediate size " + std::to_string(inter) + ": a multiple of " + std::to_string(inter_block) +
               " is needed";
    if (top_k < 1 || top_k > MOE_MAX_TOP_K)
        return std::to_string(top_k) + " routes per token: 1 to " + std::to_string(MOE_MAX_TOP_K) + " are served";
    if (static_cast<int64_t>(moe_detail::down_shared_bytes(top_k, inter)) > MOE_MAX_DOWN_SHARED)
        return std::to_string(top_k) + " routes of " + std::to_string(inter) + " values: a token's quantized h takes " +
               std::to_string(moe_detail::down_shared_bytes(top_k, inter)) + " bytes of shared memory, more than " +
               std::to_string(MOE_MAX_DOWN_SHARED);
    return "";
}

/* Bytes of packed_moe's scratch for `routes` routes of `inter` values (h's codes, scales, sums). */
inline int64_t packed_moe_scratch_bytes(int64_t routes, int64_t inter) {
    return routes * inter + routes * (inter / 32) * 4 + routes * (inter / 16) * 4;
}

/* y [T, H] = sum_k w[t, k] * down_e(act(gate_e x_t, up_e x_t)), e = ids[t, k] (table[ids[t, k]]
 * when table != 0; routes to -1 add nothing); act by its code (MOE_ACT_*), alpha and limit
 * are the clamped SwiGLU's. x [T, H] of x_dtype, ids [T, K] int32 (ids_64 0) or int64, table
 * int32, w [T, K] of w_dtype, y [T, H] of y_dtype (codes 0 f32, 1 f16, 2 bf16); gate/up [E, I, H]
 * and down [E, H, I] the experts' rows of blocks, back to back; scratch
 * packed_moe_scratch_bytes(T * K, I) bytes. x and scratch 16-byte aligned, the stacks as
 * stack_alignment says. Launched on `stream` (capturable in graphs). */
inline void packed_moe(uint64_t stream, uint64_t x, int x_dtype, int64_t tokens, uint64_t ids, int ids_64,
                       uint64_t table, uint64_t w, int w_dtype, int64_t top_k, uint64_t gate, int gate_fmt, uint64_t up,
                       int up_fmt, uint64_t down, int down_fmt, int64_t hidden, int64_t inter, int act, double alpha,
                       double limit, uint64_t scratch, uint64_t y, int y_dtype) {
    const std::string refusal = packed_moe_refusal(gate_fmt, up_fmt, down_fmt, hidden, inter, top_k, act);
    if (!refusal.empty()) throw std::invalid_argument("packed_moe: " + refusal);
    gemv_detail::check_dtype("packed_moe (x)", x_dtype);
    gemv_detail::check_dtype("packed_moe (w)", w_dtype);
    gemv_detail::check_dtype("packed_moe (y)", y_dtype);
    if (tokens < 0 || tokens * top_k > INT32_MAX || tokens > 65535)
        throw std::invalid_argument("packed_moe: " + std::to_string(tokens) + " tokens is out of range");
    const uint64_t stacks[3] = {gate, up, down};
    const int fmts[3] = {gate_fmt, up_fmt, down_fmt};
    for (int i = 0; i < 3; ++i)
        if (stacks[i] == 0 || stacks[i] % moe_detail::stack_alignment(fmts[i]))
            throw std::invalid_argument("packed_moe: the expert stacks must be 16-byte aligned (Q6_K, Q8_0: 2; MXFP4: any)");
    if (x % 16 || scratch % 16 || ids == 0 || w == 0 || y == 0 || x == 0 || scratch == 0)
        throw std::invalid_argument("packed_moe: x, ids, w, y and a 16-byte aligned scratch are needed (x aligned too)");
    if (tokens == 0) return;
    const int h = static_cast<int>(hidden), i = static_cast<int>(inter), k = static_cast<int>(top_k);
    const int64_t routes_n = tokens * top_k;
    auto* hq = reinterpret_cast<int8_t*>(scratch);
    auto* hd = reinterpret_cast<float*>(scratch + routes_n * inter);
    auto* hs = reinterpret_cast<int*>(scratch + routes_n * inter + routes_n * (inter / 32) * 4);
    const moe_detail::Routes routes{reinterpret_cast<const void*>(ids), ids_64, reinterpret_cast<const int*>(table),
                                    reinterpret_cast<const void*>(w), w_dtype, k};
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const auto* xp = reinterpret_cast<const void*>(x);
    const auto* gp = reinterpret_cast<const uint8_t*>(gate);
    const auto* up_p = reinterpret_cast<const uint8_t*>(up);
    const dim3 gu_grid(static_cast<unsigned>(routes_n), static_cast<unsigned>(i / moe_detail::kGuRows));
    const size_t gu_smem = moe_detail::gate_up_shared_bytes(h);
    const moe_detail::Activation activation{act, static_cast<float>(alpha), static_cast<float>(limit)};
    moe_detail::with_format(gate_fmt, [&](auto gf) {
        moe_detail::with_format(up_fmt, [&](auto uf) {
            constexpr int GF = decltype(gf)::value, UF = decltype(uf)::value;
            if constexpr (gemv_detail::block32(GF) == gemv_detail::block32(UF)) {
                gemv_detail::with_dtype(x_dtype, [&](auto xt) {
                    moe_detail::moe_gate_up_kernel<GF, UF, decltype(xt)::value>
                        <<<gu_grid, moe_detail::kGuThreads, gu_smem, s>>>(xp, routes, gp, up_p, h, i, activation, hq,
                                                                          hd, hs);
                    FT_CHECK_LAUNCH("moe_gate_up_kernel<<<>>>");
                });
            }
        });
    });
    const dim3 down_grid(static_cast<unsigned>((h + moe_detail::kDownWarps - 1) / moe_detail::kDownWarps),
                         static_cast<unsigned>(tokens));
    const size_t down_smem = moe_detail::down_shared_bytes(top_k, inter);
    const auto* dp = reinterpret_cast<const uint8_t*>(down);
    auto* yp = reinterpret_cast<void*>(y);
    moe_detail::with_format(down_fmt, [&](auto df) {
        gemv_detail::with_dtype(y_dtype, [&](auto yt) {
            moe_detail::moe_down_kernel<decltype(df)::value, decltype(yt)::value>
                <<<down_grid, moe_detail::kDownThreads, down_smem, s>>>(routes, hq, hd, hs, dp, h, i, yp);
            FT_CHECK_LAUNCH("moe_down_kernel<<<>>>");
        });
    });
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_PACKED_MOE_CUH */
