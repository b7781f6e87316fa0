/*
 * One token through a matrix kept as a GGUF file's Q4_K or Q6_K blocks: y[n] = sum_k x[k] W[n, k].
 *
 * The token is quantized to int8 per 32 values in each block's shared memory, exactly as the
 * Triton int8 dots do it (freetoken/moe/triton_packed_int8.py: q = floor(x * (127 / amax) + 1/2)
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
#include <mutex>
#include <stdexcept>
#include <string>

namespace freetoken_gpu {

/* element types of x and y (as the Python side names them) */
enum GemvDtype : int { GEMV_F32 = 0, GEMV_F16 = 1, GEMV_BF16 = 2 };
/* ggml block formats served here */
constexpr int GEMV_Q4_K = 12;
constexpr int GEMV_Q6_K = 14;
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
 * Each thread takes 8 consecutive values, four threads a 32-value group. Every thread runs
 * every round (the shuffles are warp-wide); rounds past K load nothing and store nothing. */
template <int DT>
__device__ void quantize_token(const void* x, int cols, int8_t* xq, float* xd, int* xs) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < cols; base += kThreads * 8) {
        const int c = base + threadIdx.x * 8;
        const bool ok = c < cols;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (ok) load8<DT>(x, c, v);
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

__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

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

template <int DT>
__device__ __forceinline__ void store_out(void* y, int row, float v) {
    if (DT == GEMV_F32) static_cast<float*>(y)[row] = v;
    else if (DT == GEMV_BF16) static_cast<__nv_bfloat16*>(y)[row] = __float2bfloat16_rn(v);
    else static_cast<__half*>(y)[row] = __float2half_rn(v);
}

template <int FMT, int XT, int YT>
__global__ void __launch_bounds__(kThreads, 8) packed_gemv_kernel(const void* __restrict__ x, const uint8_t* __restrict__ w,
                                                               void* __restrict__ y, int rows, int cols,
                                                               int64_t row_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    int8_t* xq = reinterpret_cast<int8_t*>(smem);
    float* xd = reinterpret_cast<float*>(smem + cols);
    int* xs = reinterpret_cast<int*>(smem + cols + (cols / 32) * 4);
    quantize_token<XT>(x, cols, xq, xd, xs);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int items = (cols / 256) * 4;
    for (int row = blockIdx.x * kWarps + (threadIdx.x >> 5); row < rows; row += gridDim.x * kWarps) {
        const uint8_t* wr = w + static_cast<int64_t>(row) * row_bytes;
        float acc = 0.f;
        for (int it = lane; it < items; it += 32) {
            const int b = it >> 2;
            if (FMT == GEMV_Q4_K) acc += q4k_item(wr + b * 144, b, it & 3, xq, xd, xs);
            else acc += q6k_item(wr + b * 210, b, (it >> 1) & 1, (it & 1) * 16, xq, xd, xs);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) store_out<YT>(y, row, acc);
    }
}

inline size_t shared_bytes(int cols) { return static_cast<size_t>(cols) + (cols / 32) * 4 + (cols / 16) * 4; }

/* blocks the device keeps resident for this kernel (cached per device and kernel) */
template <int FMT, int XT, int YT>
int resident_blocks(int cols) {
    static std::mutex lock;
    static std::map<std::pair<int, int>, int> known; /* (device, cols) -> blocks */
    int device = 0;
    FT_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> guard(lock);
    auto it = known.find({device, cols});
    if (it != known.end()) return it->second;
    int sms = 0, per_sm = 0;
    FT_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    FT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, packed_gemv_kernel<FMT, XT, YT>, kThreads,
                                                            shared_bytes(cols)));
    const int blocks = sms * (per_sm > 0 ? per_sm : 1);
    known[{device, cols}] = blocks;
    return blocks;
}

template <int FMT, int XT, int YT>
void launch(cudaStream_t stream, const void* x, const uint8_t* w, void* y, int rows, int cols, int64_t row_bytes) {
    const int wanted = (rows + kWarps - 1) / kWarps, resident = resident_blocks<FMT, XT, YT>(cols);
    const int grid = wanted < resident ? wanted : resident;
    packed_gemv_kernel<FMT, XT, YT><<<grid, kThreads, shared_bytes(cols), stream>>>(x, w, y, rows, cols, row_bytes);
    FT_CHECK_LAUNCH("packed_gemv_kernel<<<>>>");
}

template <int FMT, int XT>
void launch_y(int y_dtype, cudaStream_t s, const void* x, const uint8_t* w, void* y, int rows, int cols, int64_t rb) {
    switch (y_dtype) {
        case GEMV_F32: return launch<FMT, XT, GEMV_F32>(s, x, w, y, rows, cols, rb);
        case GEMV_F16: return launch<FMT, XT, GEMV_F16>(s, x, w, y, rows, cols, rb);
        default: return launch<FMT, XT, GEMV_BF16>(s, x, w, y, rows, cols, rb);
    }
}

template <int FMT>
void launch_xy(int x_dtype, int y_dtype, cudaStream_t s, const void* x, const uint8_t* w, void* y, int rows,
               int cols, int64_t rb) {
    switch (x_dtype) {
        case GEMV_F32: return launch_y<FMT, GEMV_F32>(y_dtype, s, x, w, y, rows, cols, rb);
        case GEMV_F16: return launch_y<FMT, GEMV_F16>(y_dtype, s, x, w, y, rows, cols, rb);
        default: return launch_y<FMT, GEMV_BF16>(y_dtype, s, x, w, y, rows, cols, rb);
    }
}

}  // namespace gemv_detail

/* The block formats and widths packed_gemv serves ("" if it does, else why not). */
inline std::string packed_gemv_refusal(int fmt, int64_t cols) {
    if (fmt != GEMV_Q4_K && fmt != GEMV_Q6_K)
        return "format " + std::to_string(fmt) + " is not Q4_K (12) or Q6_K (14)";
    if (cols <= 0 || cols % 256 != 0 || cols > GEMV_MAX_COLS)
        return std::to_string(cols) + " columns: a multiple of 256 up to " + std::to_string(GEMV_MAX_COLS) + " is needed";
    return "";
}

/* y [rows] = W [rows, cols] x [cols]: x, y device addresses of x_dtype / y_dtype elements
 * (x 16-byte aligned), w the rows' blocks, row_bytes apart. Launched on `stream`
 * (capturable in graphs). */
inline void packed_gemv(uint64_t stream, uint64_t x, int x_dtype, uint64_t w, int fmt, int64_t rows, int64_t cols,
                        int64_t row_bytes, uint64_t y, int y_dtype) {
    const std::string refusal = packed_gemv_refusal(fmt, cols);
    if (!refusal.empty()) throw std::invalid_argument("packed_gemv: " + refusal);
    for (int dt : {x_dtype, y_dtype})
        if (dt != GEMV_F32 && dt != GEMV_F16 && dt != GEMV_BF16)
            throw std::invalid_argument("packed_gemv: dtype code " + std::to_string(dt) + " (0 f32, 1 f16, 2 bf16)");
    const int64_t block_bytes = fmt == GEMV_Q4_K ? 144 : 210;
    if (row_bytes < cols / 256 * block_bytes)
        throw std::invalid_argument("packed_gemv: rows of " + std::to_string(row_bytes) + " bytes hold fewer than " +
                                    std::to_string(cols / 256) + " blocks");
    const int64_t align = fmt == GEMV_Q4_K ? 16 : 2;
    if (w % align || row_bytes % align)
        throw std::invalid_argument("packed_gemv: the weights and their rows must be " + std::to_string(align) +
                                    "-byte aligned for this format");
    if (x % 16) throw std::invalid_argument("packed_gemv: x must be 16-byte aligned");
    if (rows <= 0) return;
    if (rows > INT32_MAX) throw std::invalid_argument("packed_gemv: more than 2^31 rows");
    const auto* wp = reinterpret_cast<const uint8_t*>(w);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int r = static_cast<int>(rows), c = static_cast<int>(cols);
    if (fmt == GEMV_Q4_K)
        gemv_detail::launch_xy<GEMV_Q4_K>(x_dtype, y_dtype, s, reinterpret_cast<const void*>(x), wp,
                                           reinterpret_cast<void*>(y), r, c, row_bytes);
    else
        gemv_detail::launch_xy<GEMV_Q6_K>(x_dtype, y_dtype, s, reinterpret_cast<const void*>(x), wp,
                                           reinterpret_cast<void*>(y), r, c, row_bytes);
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_PACKED_GEMV_CUH */
