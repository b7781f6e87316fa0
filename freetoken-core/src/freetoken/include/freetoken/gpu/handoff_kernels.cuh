/*
 * FreeToken hand-off device code, shared by freetoken-cuda and freetoken-rocm.
 *
 * Kernels on the flag slot of include/freetoken/handoff.h (ready@0, done@8, err@16):
 *   ft_flag_write_kernel   system-scope fence, then store a value (publish without memops)
 *   ft_flag_wait_kernel    spin until a word equals a value, then reset it (wait without memops)
 *   ft_kio_publish_kernel  KernelIO publish: BF16 x + CPU routes + weights into mapped host
 *                          memory, __threadfence_system(), ready = 1; with no CPU route it
 *                          marks the task skipped (done = FT_DONE_SKIPPED) without waking the CPU
 *   ft_kio_combine_kernel  KernelIO combine: wait done != 0, out += y (mapped), done = 0
 * All flag words live in mapped host memory and are accessed through volatile
 * pointers so every read goes to memory. Waits are bounded: on timeout the kernel
 * writes err = FT_ERR_WATCHDOG, so a stream never hangs forever.
 */
#ifndef FREETOKEN_GPU_HANDOFF_KERNELS_CUH
#define FREETOKEN_GPU_HANDOFF_KERNELS_CUH

#include <freetoken/gpu/portability.h>
#include <freetoken/handoff.h>

/* done value written by the publish kernel when no route goes to the CPU. */
#define FT_DONE_SKIPPED 2ull

/* Fault injection (test-only; the default is FT_FAULT_NONE). */
#define FT_FAULT_NONE 0
#define FT_FAULT_STALE 1   /* raise ready without storing x: the CPU reads the previous x */
#define FT_FAULT_NOFENCE 2 /* raise ready before the stores, with no system fence */

namespace freetoken_gpu {

__device__ __forceinline__ uint64_t ft_volatile_load(const uint64_t* p) {
    return *reinterpret_cast<const volatile uint64_t*>(p);
}

__device__ __forceinline__ void ft_volatile_store(uint64_t* p, uint64_t v) {
    *reinterpret_cast<volatile uint64_t*>(p) = v;
}

/* A monotonic clock for the wait bounds. CUDA: %globaltimer (ns). HIP 5.x has no
 * portable constant-rate clock across gfx9/gfx10/gfx11, so the shader cycle counter is
 * used as if it ticked once per ns (GPU clocks are 1-3 GHz: the bound then fires after
 * 0.3-1x the requested time, which is fine for a safety bound). */
__device__ __forceinline__ uint64_t ft_now_ns() {
#ifdef FT_GPU_HIP
    return static_cast<uint64_t>(__clock64());
#else
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

__device__ __forceinline__ void ft_pause() {
#ifdef FT_GPU_HIP
    __builtin_amdgcn_s_sleep(2);
#else
    __nanosleep(64);
#endif
}

__device__ __forceinline__ float ft_bf16_to_float(uint16_t b) {
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ uint16_t ft_float_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return static_cast<uint16_t>(u >> 16);
}

/* Spin until *word == value or until timeout; returns true when the value was seen. */
__device__ __forceinline__ bool ft_spin_until_eq(const uint64_t* word, uint64_t value, uint64_t timeout_ns) {
    const uint64_t start = ft_now_ns();
    while (ft_volatile_load(word) != value) {
        if (ft_now_ns() - start > timeout_ns) return false;
        ft_pause();
    }
    return true;
}

/* Spin until *word != 0 or timeout; returns the value seen (0 on timeout). */
__device__ __forceinline__ uint64_t ft_spin_until_nonzero(const uint64_t* word, uint64_t timeout_ns) {
    const uint64_t start = ft_now_ns();
    uint64_t v;
    while ((v = ft_volatile_load(word)) == 0) {
        if (ft_now_ns() - start > timeout_ns) return 0;
        ft_pause();
    }
    return v;
}

__global__ void ft_flag_write_kernel(uint64_t* word, uint64_t value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        __threadfence_system(); /* everything this stream did before is visible first */
        ft_volatile_store(word, value);
        __threadfence_system();
    }
}

__global__ void ft_flag_wait_kernel(uint64_t* word, uint64_t value, uint64_t reset, uint64_t* err,
                                    uint64_t timeout_ns) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        if (!ft_spin_until_eq(word, value, timeout_ns)) {
            ft_volatile_store(err, FT_ERR_WATCHDOG);
        }
        ft_volatile_store(word, reset);
        __threadfence_system();
    }
}

/* The routes of one publish: expert ids [tokens][top_k] (int32 or int64), float32
 * weights, and which routes go to the CPU, decided in the kernel so no split kernels
 * sit on the hand-off's critical path. A route goes to the CPU when, in this order:
 * cpu_mask (bool per route) is given and set; else cpu_last_n >= 0 and it is one of
 * the token's last cpu_last_n routes; else resident (bool per expert) is given and its
 * expert is not resident; else (none given) when its id is >= 0. */
struct KioRoutes {
    const void* ids;
    int ids_are_64;
    const float* w;
    int tokens;
    int top_k;
    const uint8_t* cpu_mask;
    const uint8_t* resident;
    int cpu_last_n;
};

__device__ __forceinline__ int32_t ft_cpu_route(const KioRoutes& r, int i) {
    const int32_t id = r.ids_are_64 ? static_cast<int32_t>(static_cast<const int64_t*>(r.ids)[i])
                                    : static_cast<const int32_t*>(r.ids)[i];
    if (id < 0) return -1;
    bool cpu;
    if (r.cpu_mask) cpu = r.cpu_mask[i] != 0;
    else if (r.cpu_last_n >= 0) cpu = (i % r.top_k) >= r.top_k - r.cpu_last_n;
    else if (r.resident) cpu = r.resident[id] == 0;
    else cpu = true;
    return cpu ? id : -1;
}

/* One block. x/dst_x: n_x BF16 values; routes as above, written as CPU ids (-1 = GPU). */
__global__ void ft_kio_publish_kernel(const uint16_t* __restrict__ x, int n_x, KioRoutes routes, uint16_t* dst_x,
                                      int32_t* dst_ids, float* dst_w, uint64_t* flags, int fault) {
    __shared__ int cpu_routes;
    if (threadIdx.x == 0) cpu_routes = 0;
    __syncthreads();
    const int n_routes = routes.tokens * routes.top_k;
    int mine = 0;
    for (int i = threadIdx.x; i < n_routes; i += blockDim.x) mine += ft_cpu_route(routes, i) >= 0 ? 1 : 0;
    if (mine) atomicAdd(&cpu_routes, mine);
    __syncthreads();
    uint64_t* ready = flags + FT_FLAG_READY_OFFSET / 8;
    uint64_t* done = flags + FT_FLAG_DONE_OFFSET / 8;
    if (cpu_routes == 0) { /* empty-route skip: nothing for the CPU, do not wake it */
        if (threadIdx.x == 0) ft_volatile_store(done, FT_DONE_SKIPPED);
        return;
    }
    if (fault == FT_FAULT_NOFENCE && threadIdx.x == 0) ft_volatile_store(ready, 1ull);
    if (fault != FT_FAULT_STALE) {
        const bool vec = (n_x % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(dst_x)) % 16 == 0);
        if (vec) {
            const uint4* src4 = reinterpret_cast<const uint4*>(x);
            uint4* dst4 = reinterpret_cast<uint4*>(dst_x);
            for (int i = threadIdx.x; i < n_x / 8; i += blockDim.x) dst4[i] = src4[i];
        } else {
            for (int i = threadIdx.x; i < n_x; i += blockDim.x) dst_x[i] = x[i];
        }
    }
    for (int i = threadIdx.x; i < n_routes; i += blockDim.x) {
        dst_ids[i] = ft_cpu_route(routes, i);
        dst_w[i] = routes.w[i];
    }
    if (fault == FT_FAULT_NOFENCE) return;
    __threadfence_system(); /* this thread's stores reach host memory before ready */
    __syncthreads();
    if (threadIdx.x == 0) ft_volatile_store(ready, 1ull);
}

/* One block. out: n BF16 values on the device; y: n values (BF16 or FP32) in mapped memory. */
__global__ void ft_kio_combine_kernel(uint16_t* __restrict__ out, const void* y, int y_is_f32, int n,
                                      uint64_t* flags, uint64_t timeout_ns) {
    __shared__ uint64_t seen;
    uint64_t* done = flags + FT_FLAG_DONE_OFFSET / 8;
    uint64_t* err = flags + FT_FLAG_ERR_OFFSET / 8;
    if (threadIdx.x == 0) {
        seen = ft_spin_until_nonzero(done, timeout_ns);
        if (seen == 0) ft_volatile_store(err, FT_ERR_WATCHDOG);
    }
    __syncthreads();
    if (seen == 1ull && ft_volatile_load(err) == 0) {
        /* Four loads from host memory in flight per thread before any is used: each is a
         * bus round trip, so issuing them back to back hides most of the latency. */
        const volatile float* yf = reinterpret_cast<const volatile float*>(y);
        const volatile uint16_t* yb = reinterpret_cast<const volatile uint16_t*>(y);
        const int stride = static_cast<int>(blockDim.x);
        for (int base = threadIdx.x; base < n; base += 4 * stride) {
            float yv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * stride;
                yv[j] = i < n ? (y_is_f32 ? yf[i] : ft_bf16_to_float(yb[i])) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * stride;
                if (i < n) out[i] = ft_float_to_bf16(ft_bf16_to_float(out[i]) + yv[j]);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ft_volatile_store(done, 0ull);
        __threadfence_system();
    }
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_HANDOFF_KERNELS_CUH */
