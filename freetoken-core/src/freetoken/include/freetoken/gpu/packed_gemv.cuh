/*
 * One token through a matrix kept as a GGUF file's Q4_K, Q6_K or Q8_0 blocks: y[n] = sum_k x[k] W[n, k].
 *
 * The token is quantized to int8 per 32 values in each block's shared memory, exactly as the
 * Triton int8 dots do it (freetoken/kernels/packed_int8.py: q = floor(x * (127 / amax) + 1/2)
 * with a correctly rounded division and one rounding of the fma, scale amax * (1/127)), and the
 * weights' codes stay integers, four to a word, multiplied four at a time by dp4a.
 *
 * One warp computes one row at a time (rows strided over the grid, which is sized to the
 * blocks the device keeps resident, so a wide matrix such as an output head quantizes the
 * token once per block, not once per row). A lane takes a quarter of a 256-value block:
 *   Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles):
 *     the 32 bytes of one pair of 32-value sub-blocks (low nibbles, then high nibbles);
 *     per sub-block d*sc * dx * sum(q * xq) - dmin*m * dx * sum(xq).
 *   Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d):
 *     16 positions of one 128-value half, which feed four 16-value sub-blocks;
 *     per sub-block d*sc * dx * (sum(q * xq) - 32 * sum(xq)). Its blocks align to 2 bytes
 *     only, so words are put together from 16-bit loads.
 *   Q8_0 (34 bytes: d, 32 int8 codes): a whole block, d * dx * sum(q * xq); 2-byte aligned as
 *     Q6_K. Its rows need only a multiple of 32 values (the K-quants: of 256), which is what
 *     rows such as GLM-4.5-Air's 1408-value expert down projections are written in.
 *   MXFP4 (17 bytes: E8M0 exponent, 16 bytes of E2M1 codes): a whole block as Q8_0, the codes
 *     turned into int8 values by byte permutations; served to the routed-expert kernels
 *     (packed_moe.cuh) only, as GPT-OSS's experts are its only MXFP4 tensors.
 *
 * NVIDIA only (dp4a and 32-lane warps); the bindings leave it out of HIP builds.
 */
#ifndef FREETOKEN_GPU_PACKED_GEMV_CUH
#define FREETOKEN_GPU_PACKED_GEMV_CUH

#include <freetoken/gpu/portability.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace freetoken_gpu {

/* element types of x and y (as the Python side names them) */
enum GemvDtype : int { GEMV_F32 = 0, GEMV_F16 = 1, GEMV_BF16 = 2 };
/* ggml block formats served here */
constexpr int GEMV_Q8_0 = 8;
constexpr int GEMV_Q4_K = 12;
constexpr int GEMV_Q6_K = 14;
/* served by the routed-expert kernels (packed_moe.cuh) only */
constexpr int GEMV_MXFP4 = 39;
/* the longest token: its int8 codes, scales and 16-value sums stay in shared memory */
constexpr int GEMV_MAX_COLS = 16384;

namespace gemv_detail {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int DT>
__device__ __forceinline__ void load8(const void* x, int c, float v[8]) {
    if (DT == GEMV_F32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + c);
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + c);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint16_t lo = static_cast<uint16_t>(w[i] & 0xFFFFu), hi = static_cast<uint16_t>(w[i] >> 16);
            if (DT == GEMV_BF16) {
                v[2 * i] = __uint_as_float(static_cast<uint32_t>(lo) << 16);
                v[2 * i + 1] = __uint_as_float(static_cast<uint32_t>(hi) << 16);
            } else {
                v[2 * i] = __half2float(__ushort_as_half(lo));
                v[2 * i + 1] = __half2float(__ushort_as_half(hi));
            }
        }
    }
}

/* The token into shared memory: codes xq[K] (int8), scales xd[K/32] and code sums xs[K/16].
 * Each of the block's Threads threads takes 8 consecutive values (src(c, v) gives the 8 from
 * column c), four threads a 32-value group. Every thread runs every round (the shuffles are
 * warp-wide); rounds past K load nothing and store nothing. */
template <int Threads = kThreads, class Source>
__device__ void quantize_from(const Source& src, int cols, int8_t* xq, float* xd, int* xs) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < cols; base += Threads * 8) {
        const int c = base + threadIdx.x * 8;
        const bool ok = c < cols;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (ok) src(c, v);
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
        int q[8], sum = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = static_cast<int>(floorf(__fmaf_rn(v[i], inv, 0.5f)));
            sum += q[i];
        }
        const int pair = sum + __shfl_xor_sync(0xffffffffu, sum, 1); /* this 16-value half's sum */
        if (ok) {
            uint2 words = {0u, 0u};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                words.x |= static_cast<uint32_t>(q[i] & 255) << (8 * i);
                words.y |= static_cast<uint32_t>(q[i + 4] & 255) << (8 * i);
            }
            *reinterpret_cast<uint2*>(xq + c) = words;
            if ((lane & 1) == 0) xs[c / 16] = pair;
            if ((lane & 3) == 0) xd[c / 32] = amax * (1.0f / 127.0f);
        }
    }
}

/* bytes of what quantize_from leaves in shared memory for a token of `cols` values */
__host__ __device__ inline size_t shared_bytes(int cols) {
    return static_cast<size_t>(cols) + (cols / 32) * 4 + (cols / 16) * 4;
}

/* the token as given */
template <int DT>
struct TokenValues {
    const void* x;
    __device__ void operator()(int c, float v[8]) const { load8<DT>(x, c, v); }
};

__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

/* whether a format's blocks hold 32 values (Q8_0, MXFP4: a lane item is a whole block) */
__host__ __device__ constexpr bool block32(int fmt) { return fmt == GEMV_Q8_0 || fmt == GEMV_MXFP4; }
/* values and bytes of one block of a served format */
__host__ __device__ constexpr int block_values(int fmt) { return block32(fmt) ? 32 : 256; }
__host__ __device__ constexpr int block_bytes(int fmt) {
    return fmt == GEMV_Q4_K ? 144 : fmt == GEMV_Q6_K ? 210 : fmt == GEMV_MXFP4 ? 17 : 34;
}
/* bytes of a row of `cols` values */
__host__ __device__ constexpr int64_t row_bytes_of(int fmt, int64_t cols) {
    return cols / block_values(fmt) * block_bytes(fmt);
}
/* a lane's items of a row of `cols` values: a quarter of a K-quant block, a whole Q8_0 or MXFP4 block */
__host__ __device__ constexpr int items_of(int fmt, int cols) {
    return block32(fmt) ? cols / 32 : cols / 256 * 4;
}

__device__ __forceinline__ uint32_t word16(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
}

/* Q4_K: lane item (block b, quarter j) = sub-blocks 2j (low nibbles) and 2j+1 (high nibbles) */
__device__ __forceinline__ float q4k_item(const uint8_t* blk, int b, int j, const int8_t* xq, const float* xd,
                                          const int* xs) {
    const uint4 head = *reinterpret_cast<const uint4*>(blk);
    const uint4 qa = *reinterpret_cast<const uint4*>(blk + 16 + 32 * j);
    const uint4 qb = *reinterpret_cast<const uint4*>(blk + 32 + 32 * j);
    const float d = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x >> 16)));
    const uint32_t sw[3] = {head.y, head.z, head.w};
    auto sbyte = [&](int i) -> int { return static_cast<int>((sw[i >> 2] >> (8 * (i & 3))) & 255u); };
    int sc[2], mn[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        if (s < 4) {
            sc[h] = sbyte(s) & 63;
            mn[h] = sbyte(s + 4) & 63;
        } else {
            sc[h] = (sbyte(s + 4) & 15) | ((sbyte(s - 4) >> 6) << 4);
            mn[h] = (sbyte(s + 4) >> 4) | ((sbyte(s) >> 6) << 4);
        }
    }
    const uint32_t w[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    const int4* xw = reinterpret_cast<const int4*>(xq + b * 256 + 64 * j);
    const int4 x0 = xw[0], x1 = xw[1], x2 = xw[2], x3 = xw[3];
    const int lo[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const int hi[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        s0 = dp4a(static_cast<int>(w[i] & 0x0F0F0F0Fu), lo[i], s0);
        s1 = dp4a(static_cast<int>((w[i] >> 4) & 0x0F0F0F0Fu), hi[i], s1);
    }
    const int g = b * 8 + 2 * j; /* 32-value groups of the two sub-blocks: g, g + 1 */
    const float dx0 = xd[g], dx1 = xd[g + 1];
    return d * static_cast<float>(sc[0]) * dx0 * static_cast<float>(s0) -
           dmin * static_cast<float>(mn[0]) * dx0 * static_cast<float>(xs[2 * g] + xs[2 * g + 1]) +
           d * static_cast<float>(sc[1]) * dx1 * static_cast<float>(s1) -
           dmin * static_cast<float>(mn[1]) * dx1 * static_cast<float>(xs[2 * g + 2] + xs[2 * g + 3]);
}

/* Q6_K: lane item (block b, half h, positions l0 .. l0 + 16) feeds the sub-blocks of values
 * 128h + 32m + l0 .. + 16 for m = 0..3 */
__device__ __forceinline__ float q6k_item(const uint8_t* blk, int b, int h, int l0, const int8_t* xq,
                                          const float* xd, const int* xs) {
    const uint8_t* ql = blk + 64 * h + l0;
    const uint8_t* qh = blk + 128 + 32 * h + l0;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + l0 / 16);
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(blk + 208)));
    int sum[4] = {0, 0, 0, 0};
    const int base = b * 256 + 128 * h + l0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t a = word16(ql + 4 * i), c = word16(ql + 32 + 4 * i), hb = word16(qh + 4 * i);
        const int q0 = static_cast<int>((a & 0x0F0F0F0Fu) | ((hb & 0x03030303u) << 4));
        const int q1 = static_cast<int>((c & 0x0F0F0F0Fu) | (((hb >> 2) & 0x03030303u) << 4));
        const int q2 = static_cast<int>(((a >> 4) & 0x0F0F0F0Fu) | (((hb >> 4) & 0x03030303u) << 4));
        const int q3 = static_cast<int>(((c >> 4) & 0x0F0F0F0Fu) | (((hb >> 6) & 0x03030303u) << 4));
        sum[0] = dp4a(q0, *reinterpret_cast<const int*>(xq + base + 4 * i), sum[0]);
        sum[1] = dp4a(q1, *reinterpret_cast<const int*>(xq + base + 32 + 4 * i), sum[1]);
        sum[2] = dp4a(q2, *reinterpret_cast<const int*>(xq + base + 64 + 4 * i), sum[2]);
        sum[3] = dp4a(q3, *reinterpret_cast<const int*>(xq + base + 96 + 4 * i), sum[3]);
    }
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int v = base + 32 * m;
        acc += static_cast<float>(sc[2 * m]) * xd[v / 32] * static_cast<float>(sum[m] - 32 * xs[v / 16]);
    }
    return d * acc;
}

/* Q8_0: lane item = block b, against the token's 32-value group b */
__device__ __forceinline__ float q8_0_item(const uint8_t* blk, int b, const int8_t* xq, const float* xd) {
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(blk)));
    const int4* xw = reinterpret_cast<const int4*>(xq + b * 32);
    const int4 x0 = xw[0], x1 = xw[1];
    const int xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum = dp4a(static_cast<int>(word16(blk + 2 + 4 * i)), xv[i], sum);
    return d * xd[b] * static_cast<float>(sum);
}

/* Four MXFP4 codes (one a byte, 0..15) to their int8 values {0, 1, 2, 3, 4, 6, 8, 12} and the
 * negatives (code bit 3: the sign): ggml's doubled E2M1 values, whose scale is half the
 * block's E8M0 power of two. The magnitudes come from two byte permutations over the eight
 * positive and the eight negative values, the sign bit picks between them per byte. */
__device__ __forceinline__ int mxfp4_values(uint32_t codes) {
    const uint32_t idx = codes & 0x07070707u;
    const uint32_t packed = idx | (idx >> 4); /* selector nibbles 0, 1 in bits 0-7; 2, 3 in bits 16-23 */
    const uint32_t sel = (packed & 0xFFu) | ((packed >> 8) & 0xFF00u);
    const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, sel);
    const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);
    const uint32_t negative = ((codes >> 3) & 0x01010101u) * 0xFFu;
    return static_cast<int>((pos & ~negative) | (neg & negative));
}

/* MXFP4 (17 bytes: E8M0 exponent e, 16 bytes of codes; element j < 16 the low nibble of code
 * byte j, element j + 16 its high nibble): lane item = block b, against the token's group b;
 * 2^(e - 128) * dx * sum(value * xq), exponents 0 and 1 (float32 subnormals) as zero, as the
 * CPU kernels count them. Blocks are byte-aligned: the code bytes come from five aligned
 * words put together with funnel shifts (the fifth only where the bytes straddle it). */
__device__ __forceinline__ float mxfp4_item(const uint8_t* blk, int b, const int8_t* xq, const float* xd) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(blk + 1);
    const uint32_t* base = reinterpret_cast<const uint32_t*>(at & ~static_cast<uintptr_t>(3));
    const uint32_t shift = static_cast<uint32_t>(at & 3) * 8;
    uint32_t w[5];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = base[i];
    w[4] = shift ? base[4] : 0u;
    const int4* xw = reinterpret_cast<const int4*>(xq + b * 32);
    const int4 x0 = xw[0], x1 = xw[1];
    const int lo[4] = {x0.x, x0.y, x0.z, x0.w};
    const int hi[4] = {x1.x, x1.y, x1.z, x1.w};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t c = __funnelshift_r(w[i], w[i + 1], shift);
        sum = dp4a(mxfp4_values(c & 0x0F0F0F0Fu), lo[i], sum);
        sum = dp4a(mxfp4_values((c >> 4) & 0x0F0F0F0Fu), hi[i], sum);
    }
    const uint32_t e = blk[0];
    const float scale = e >= 2 ? __uint_as_float((e - 1) << 23) : 0.f;
    return scale * xd[b] * static_cast<float>(sum);
}

template <int DT>
__device__ __forceinline__ void store_out(void* y, int row, float v) {
    if (DT == GEMV_F32) static_cast<float*>(y)[row] = v;
    else if (DT == GEMV_BF16) static_cast<__nv_bfloat16*>(y)[row] = __float2bfloat16_rn(v);
    else static_cast<__half*>(y)[row] = __float2half_rn(v);
}


/* v summed over the warp (every lane gets the sum) */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* item `it` of a row wr (four per 256-value block, one per Q8_0 or MXFP4 block: a lane's share)
 * against the quantized token */
template <int FMT>
__device__ __forceinline__ float row_item(const uint8_t* wr, int it, const int8_t* xq, const float* xd,
                                          const int* xs) {
    if (FMT == GEMV_Q8_0) return q8_0_item(wr + it * block_bytes(FMT), it, xq, xd);
    if (FMT == GEMV_MXFP4) return mxfp4_item(wr + it * block_bytes(FMT), it, xq, xd);
    const int b = it >> 2;
    if (FMT == GEMV_Q4_K) return q4k_item(wr + b * block_bytes(FMT), b, it & 3, xq, xd, xs);
    return q6k_item(wr + b * block_bytes(FMT), b, (it >> 1) & 1, (it & 1) * 16, xq, xd, xs);
}

/* one row's dot with the quantized token, summed over the warp (every lane gets the sum) */
template <int FMT>
__device__ __forceinline__ float row_dot(const uint8_t* wr, int cols, const int8_t* xq, const float* xd,
                                         const int* xs) {
    const int lane = threadIdx.x & 31;
    const int items = items_of(FMT, cols);
    float acc = 0.f;
    for (int it = lane; it < items; it += 32) acc += row_item<FMT>(wr, it, xq, xd, xs);
    return warp_sum(acc);
}

/* The bytes of a warp's first row asked into L2 (a lane per 128-byte line) before the token is
 * quantized, so the first row's loads are under way while the block prepares its input. */
__device__ __forceinline__ void prefetch_row(const uint8_t* row, int bytes) {
    for (int off = (threadIdx.x & 31) * 128; off < bytes; off += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
}

template <int FMT, int XT, int YT>
__global__ void __launch_bounds__(kThreads, 8) packed_gemv_kernel(const void* __restrict__ x, const uint8_t* __restrict__ w,
                                                               void* __restrict__ y, int rows, int cols,
                                                               int64_t row_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    int8_t* xq = reinterpret_cast<int8_t*>(smem);
    float* xd = reinterpret_cast<float*>(smem + cols);
    int* xs = reinterpret_cast<int*>(smem + cols + (cols / 32) * 4);
    const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (first < rows) prefetch_row(w + static_cast<int64_t>(first) * row_bytes, row_bytes_of(FMT, cols));
    quantize_from(TokenValues<XT>{x}, cols, xq, xd, xs);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int row = first; row < rows; row += gridDim.x * kWarps) {
        const float acc = row_dot<FMT>(w + static_cast<int64_t>(row) * row_bytes, cols, xq, xd, xs);
        if (lane == 0) store_out<YT>(y, row, acc);
    }
}

/* ---- the same GEMV with the decoder's pre-norm in front, over one or two matrices ----------- */

/* v rounded to the activations' dtype (a store in it and a load back) */
template <int DT>
__device__ __forceinline__ float round_to(float v) {
    if (DT == GEMV_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    if (DT == GEMV_F16) return __half2float(__float2half_rn(v));
    return v;
}

template <int DT>
__device__ __forceinline__ void store8(void* p, int c, const float v[8]) {
    if (DT == GEMV_F32) {
        float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + c);
        q[0] = make_float4(v[0], v[1], v[2], v[3]);
        q[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t lo, hi;
            if (DT == GEMV_BF16) {
                lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
                hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
            } else {
                lo = __half_as_ushort(__float2half_rn(v[2 * i]));
                hi = __half_as_ushort(__float2half_rn(v[2 * i + 1]));
            }
            w[i] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* The pre-norm's operands: the residual h, what the previous block adds to it (delta, or
 * null), the norm's weight and epsilon; block 0 stores h + delta (h_out, when delta is given)
 * and the normed token (x_out). All of the activations' dtype. */
struct NormArgs {
    const void* h;
    const void* delta;
    const void* weight;
    void* h_out;
    void* x_out;
    float eps;
};

/* one matrix of a fused call: rows of blocks row_bytes apart, outputs y[rows] */
struct GemvPart {
    const uint8_t* w;
    int64_t row_bytes;
    int rows;
    void* y;
};

/* h + delta rounded to the dtype, as the dense ops' add_rms_norm stores it */
template <int DT>
__device__ __forceinline__ void residual8(const NormArgs& n, int c, float hv[8]) {
    load8<DT>(n.h, c, hv);
    if (n.delta != nullptr) {
        float dv[8];
        load8<DT>(n.delta, c, dv);
#pragma unroll
        for (int i = 0; i < 8; ++i) hv[i] = round_to<DT>(hv[i] + dv[i]);
    }
}

/* the normed token: weight * (residual * r), each product rounded to the dtype */
template <int DT>
struct NormedValues {
    NormArgs n;
    float r;
    bool store;
    __device__ void operator()(int c, float v[8]) const {
        float hv[8], wv[8];
        residual8<DT>(n, c, hv);
        load8<DT>(n.weight, c, wv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = round_to<DT>(wv[i] * round_to<DT>(hv[i] * r));
        if (store) {
            if (n.delta != nullptr) store8<DT>(n.h_out, c, hv);
            store8<DT>(n.x_out, c, v);
        }
    }
};

/* y_a = A x, y_b = B x for x = rmsnorm(h + delta) * weight: every block computes the norm
 * (the token is a few KB, read from L2) and quantizes x as packed_gemv_kernel does; the rows of
 * A then B are strided over the warps of the grid. b.rows may be 0. */
template <int FA, int FB, int DT>
__global__ void __launch_bounds__(kThreads, 8) packed_gemv_norm_kernel(NormArgs n, GemvPart a, GemvPart b, int cols) {
    extern __shared__ __align__(16) unsigned char smem[];
    int8_t* xq = reinterpret_cast<int8_t*>(smem);
    float* xd = reinterpret_cast<float*>(smem + cols);
    int* xs = reinterpret_cast<int*>(smem + cols + (cols / 32) * 4);
    float* partial = reinterpret_cast<float*>(smem + shared_bytes(cols));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows = a.rows + b.rows, first = blockIdx.x * kWarps + warp;
    if (first < a.rows)
        prefetch_row(a.w + static_cast<int64_t>(first) * a.row_bytes, row_bytes_of(FA, cols));
    else if (first < rows)
        prefetch_row(b.w + static_cast<int64_t>(first - a.rows) * b.row_bytes, row_bytes_of(FB, cols));
    float ss = 0.f;
    for (int c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
        float hv[8];
        residual8<DT>(n, c, hv);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += hv[i] * hv[i];
    }
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += partial[i];
    const float r = rsqrtf(total / static_cast<float>(cols) + n.eps);
    quantize_from(NormedValues<DT>{n, r, blockIdx.x == 0}, cols, xq, xd, xs);
    __syncthreads();
    for (int row = first; row < rows; row += gridDim.x * kWarps) {
        if (row < a.rows) {
            const float acc = row_dot<FA>(a.w + static_cast<int64_t>(row) * a.row_bytes, cols, xq, xd, xs);
            if (lane == 0) store_out<DT>(a.y, row, acc);
        } else {
            const int rb = row - a.rows;
            const float acc = row_dot<FB>(b.w + static_cast<int64_t>(rb) * b.row_bytes, cols, xq, xd, xs);
            if (lane == 0) store_out<DT>(b.y, rb, acc);
        }
    }
}

inline size_t norm_shared_bytes(int cols) { return shared_bytes(cols) + kWarps * sizeof(float); }


/* blocks the device keeps resident for `kernel` with `smem` bytes of shared memory (cached
 * per device, kernel and size) */
template <class Kernel>
int resident_blocks(Kernel kernel, size_t smem) {
    static std::mutex lock;
    static std::map<std::tuple<int, const void*, size_t>, int> known;
    int device = 0;
    FT_CHECK(cudaGetDevice(&device));
    const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), smem);
    std::lock_guard<std::mutex> guard(lock);
    auto it = known.find(key);
    if (it != known.end()) return it->second;
    int sms = 0, per_sm = 0;
    FT_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    FT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    const int blocks = sms * (per_sm > 0 ? per_sm : 1);
    known[key] = blocks;
    return blocks;
}

/* a warp per row, at most the resident blocks */
template <class Kernel>
int grid_for(Kernel kernel, size_t smem, int rows) {
    const int wanted = (rows + kWarps - 1) / kWarps, resident = resident_blocks(kernel, smem);
    return wanted < resident ? wanted : resident;
}

template <int FMT, int XT, int YT>
void launch(cudaStream_t stream, const void* x, const uint8_t* w, void* y, int rows, int cols, int64_t row_bytes) {
    auto kernel = packed_gemv_kernel<FMT, XT, YT>;
    const size_t smem = shared_bytes(cols);
    kernel<<<grid_for(kernel, smem, rows), kThreads, smem, stream>>>(x, w, y, rows, cols, row_bytes);
    FT_CHECK_LAUNCH("packed_gemv_kernel<<<>>>");
}

template <int FA, int FB, int DT>
void launch_norm(cudaStream_t stream, const NormArgs& n, const GemvPart& a, const GemvPart& b, int cols) {
    auto kernel = packed_gemv_norm_kernel<FA, FB, DT>;
    const size_t smem = norm_shared_bytes(cols);
    kernel<<<grid_for(kernel, smem, a.rows + b.rows), kThreads, smem, stream>>>(n, a, b, cols);
    FT_CHECK_LAUNCH("packed_gemv_norm_kernel<<<>>>");
}

/* f(std::integral_constant<int, C>) for the first C of the codes equal to `code`, else for the
 * last (the caller has checked `code`): a runtime code to a kernel's template argument */
template <int C, int... Rest, class F>
void with_code(int code, F&& f) {
    if constexpr (sizeof...(Rest) == 0) {
        f(std::integral_constant<int, C>{});
    } else {
        if (code == C) return f(std::integral_constant<int, C>{});
        with_code<Rest...>(code, f);
    }
}

template <class F>
void with_format(int fmt, F&& f) { with_code<GEMV_Q4_K, GEMV_Q6_K, GEMV_Q8_0>(fmt, f); }

template <class F>
void with_dtype(int dtype, F&& f) { with_code<GEMV_F32, GEMV_F16, GEMV_BF16>(dtype, f); }

}  // namespace gemv_detail

/* The block formats and widths packed_gemv serves ("" if it does, else why not). */
inline std::string packed_gemv_refusal(int fmt, int64_t cols) {
    if (fmt != GEMV_Q4_K && fmt != GEMV_Q6_K && fmt != GEMV_Q8_0)
        return "format " + std::to_string(fmt) + " is not Q8_0 (8), Q4_K (12) or Q6_K (14)";
    const int per_block = gemv_detail::block_values(fmt);
    if (cols <= 0 || cols % per_block != 0 || cols > GEMV_MAX_COLS)
        return std::to_string(cols) + " columns: a multiple of " + std::to_string(per_block) + " up to " +
               std::to_string(GEMV_MAX_COLS) + " is needed";
    return "";
}

namespace gemv_detail {

inline void check_dtype(const char* what, int dt) {
    if (dt != GEMV_F32 && dt != GEMV_F16 && dt != GEMV_BF16)
        throw std::invalid_argument(std::string(what) + ": dtype code " + std::to_string(dt) + " (0 f32, 1 f16, 2 bf16)");
}

/* a matrix's format, width, row size and alignment as the kernels need them */
inline void check_matrix(const char* what, uint64_t w, int fmt, int64_t rows, int64_t cols, int64_t row_bytes) {
    const std::string refusal = packed_gemv_refusal(fmt, cols);
    if (!refusal.empty()) throw std::invalid_argument(std::string(what) + ": " + refusal);
    if (row_bytes < row_bytes_of(fmt, cols))
        throw std::invalid_argument(std::string(what) + ": rows of " + std::to_string(row_bytes) +
                                    " bytes hold fewer than " + std::to_string(cols / block_values(fmt)) + " blocks");
    const int64_t align = fmt == GEMV_Q4_K ? 16 : 2; /* Q6_K and Q8_0 blocks: 2 bytes */
    if (w % align || row_bytes % align)
        throw std::invalid_argument(std::string(what) + ": the weights and their rows must be " +
                                    std::to_string(align) + "-byte aligned for this format");
    if (rows < 0 || rows > INT32_MAX) throw std::invalid_argument(std::string(what) + ": rows out of range");
}

}  // namespace gemv_detail

/* y [rows] = W [rows, cols] x [cols]: x, y device addresses of x_dtype / y_dtype elements
 * (x 16-byte aligned), w the rows' blocks, row_bytes apart. Launched on `stream`
 * (capturable in graphs). */
inline void packed_gemv(uint64_t stream, uint64_t x, int x_dtype, uint64_t w, int fmt, int64_t rows, int64_t cols,
                        int64_t row_bytes, uint64_t y, int y_dtype) {
    gemv_detail::check_matrix("packed_gemv", w, fmt, rows, cols, row_bytes);
    gemv_detail::check_dtype("packed_gemv", x_dtype);
    gemv_detail::check_dtype("packed_gemv", y_dtype);
    if (x % 16) throw std::invalid_argument("packed_gemv: x must be 16-byte aligned");
    if (rows <= 0) return;
    const auto* wp = reinterpret_cast<const uint8_t*>(w);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int r = static_cast<int>(rows), c = static_cast<int>(cols);
    const auto* xp = reinterpret_cast<const void*>(x);
    auto* yp = reinterpret_cast<void*>(y);
    gemv_detail::with_format(fmt, [&](auto f) {
        gemv_detail::with_dtype(x_dtype, [&](auto xt) {
            gemv_detail::with_dtype(y_dtype, [&](auto yt) {
                gemv_detail::launch<decltype(f)::value, decltype(xt)::value, decltype(yt)::value>(s, xp, wp, yp, r, c,
                                                                                                  row_bytes);
            });
        });
    });
}

/* The decoder's pre-norm and the projections that read it, one launch: x = weight *
 * rmsnorm(h + delta) (delta 0: none; h + delta stored in h_out, x in x_out), then
 * y_a [rows_a] = A x and y_b [rows_b] = B x (rows_b 0: A only). Every vector is of `dtype`
 * (0 f32, 1 f16, 2 bf16) and 16-byte aligned; A and B as packed_gemv's W. */
inline void packed_gemv_norm(uint64_t stream, uint64_t h, uint64_t delta, uint64_t weight, double eps, uint64_t h_out,
                             uint64_t x_out, int dtype, int64_t cols, uint64_t w_a, int fmt_a, int64_t rows_a,
                             int64_t row_bytes_a, uint64_t y_a, uint64_t w_b, int fmt_b, int64_t rows_b,
                             int64_t row_bytes_b, uint64_t y_b) {
    gemv_detail::check_dtype("packed_gemv_norm", dtype);
    gemv_detail::check_matrix("packed_gemv_norm (first matrix)", w_a, fmt_a, rows_a, cols, row_bytes_a);
    if (rows_b > 0) gemv_detail::check_matrix("packed_gemv_norm (second matrix)", w_b, fmt_b, rows_b, cols, row_bytes_b);
    for (uint64_t p : {h, delta, weight, h_out, x_out})
        if (p % 16) throw std::invalid_argument("packed_gemv_norm: h, delta, weight, h_out and x_out must be 16-byte aligned");
    if (h == 0 || weight == 0 || x_out == 0 || (delta != 0 && h_out == 0))
        throw std::invalid_argument("packed_gemv_norm: h, weight, x_out (and h_out with a delta) are needed");
    if (rows_a + (rows_b > 0 ? rows_b : 0) > INT32_MAX) throw std::invalid_argument("packed_gemv_norm: more than 2^31 rows");
    const gemv_detail::NormArgs n{reinterpret_cast<const void*>(h), reinterpret_cast<const void*>(delta),
                                  reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(h_out),
                                  reinterpret_cast<void*>(x_out), static_cast<float>(eps)};
    const gemv_detail::GemvPart a{reinterpret_cast<const uint8_t*>(w_a), row_bytes_a, static_cast<int>(rows_a),
                                  reinterpret_cast<void*>(y_a)};
    const gemv_detail::GemvPart b{reinterpret_cast<const uint8_t*>(w_b), row_bytes_b,
                                  rows_b > 0 ? static_cast<int>(rows_b) : 0, reinterpret_cast<void*>(y_b)};
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int c = static_cast<int>(cols);
    gemv_detail::with_format(fmt_a, [&](auto fa) {
        gemv_detail::with_format(rows_b > 0 ? fmt_b : fmt_a, [&](auto fb) {
            gemv_detail::with_dtype(dtype, [&](auto dt) {
                gemv_detail::launch_norm<decltype(fa)::value, decltype(fb)::value, decltype(dt)::value>(s, n, a, b, c);
            });
        });
    });
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_PACKED_GEMV_CUH */
