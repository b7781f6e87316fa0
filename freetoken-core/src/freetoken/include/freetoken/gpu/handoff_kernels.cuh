/*
 * FreeToken hand-off device code, shared by freetoken-cuda and freetoken-rocm.
 *
 * Kernels on the flag slot of include/freetoken/handoff.h (ready@0, done@8, err@16):
 *   ft_flag_write_kernel   system-scope fence, then store a value (publish without memops)
 *   ft_flag_wait_kernel    spin until a word equals a value, then reset it (wait without memops;
 *                          on timeout err = FT_ERR_WATCHDOG unless err is null)
 *   ft_kio_publish_kernel  KernelIO publish: BF16 x + CPU routes + weights into mapped host
 *                          memory, __threadfence_system(), ready = 1; with no CPU route it
 *                          marks the task skipped (done = FT_DONE_SKIPPED) without waking the CPU
 *   ft_kio_combine_kernel  KernelIO combine: wait done != 0, done = 0, out += y (mapped)
 * All flag words live in mapped host memory and are accessed through volatile
 * pointers (waits on done: acquire loads) so every read goes to memory. Waits are
 * bounded: on timeout the kernel writes err = FT_ERR_WATCHDOG, so a stream never hangs
 * forever. The KernelIO kernels also stamp the slot's diagnostic GPU clock words
 * (handoff.h), which the coordinator's stage trace reads.
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

/* A load with acquire semantics at system scope: memory operations after it (of this
 * thread, and of the block after a barrier) are not satisfied before it. */
__device__ __forceinline__ uint64_t ft_acquire_load_sys(const uint64_t* p) {
#ifdef FT_GPU_HIP
    const uint64_t v = ft_volatile_load(p);
    __threadfence_system();
    return v;
#else
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#endif
}

/* Spin until *word != 0 or timeout; returns the value seen (0 on timeout), read with
 * acquire semantics so what the writer stored before it is visible after. */
__device__ __forceinline__ uint64_t ft_spin_until_nonzero(const uint64_t* word, uint64_t timeout_ns) {
    const uint64_t start = ft_now_ns();
    uint64_t v;
#ifdef FT_GPU_HIP
    while ((v = ft_volatile_load(word)) == 0) {
        if (ft_now_ns() - start > timeout_ns) return 0;
        ft_pause();
    }
    __threadfence_system(); /* acquire: the reads after this see what preceded the flag */
#else
    /* every poll is an acquire load (no second read of the flag after it changes) */
    while ((v = ft_acquire_load_sys(word)) == 0) {
        if (ft_now_ns() - start > timeout_ns) return 0;
        ft_pause();
    }
#endif
    return v;
}

/* Four consecutive values of y[i..i+3] (FP32 or BF16, host memory written by the CPU)
 * as floats, read past every cache (uncached vector load where aligned); past n: 0. */
__device__ __forceinline__ float4 ft_load_y4(const void* y, int y_is_f32, int i, int n) {
    float v[4];
    if (y_is_f32 && i + 4 <= n && (reinterpret_cast<uintptr_t>(y) % 16) == 0) {
#ifdef FT_GPU_HIP
        const volatile float* yf = static_cast<const volatile float*>(y) + i;
        return make_float4(yf[0], yf[1], yf[2], yf[3]);
#else
        return __ldcv(reinterpret_cast<const float4*>(static_cast<const float*>(y) + i));
#endif
    }
    const volatile float* yf = static_cast<const volatile float*>(y);
    const volatile uint16_t* yb = static_cast<const volatile uint16_t*>(y);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j < n ? (y_is_f32 ? yf[i + j] : ft_bf16_to_float(yb[i + j])) : 0.0f;
    return make_float4(v[0], v[1], v[2], v[3]);
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
        if (!ft_spin_until_eq(word, value, timeout_ns) && err) {
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

/* One block. x/dst_x: n_x BF16 values; routes as above, written as CPU ids (-1 = GPU).
 * The stores go out first (posted writes: they cost the GPU nearly nothing, also when
 * no route turns out to be the CPU's), then one barrier counts the CPU routes; only a
 * task with CPU routes pays the system fence and raises ready. Each thread issues its
 * first device loads (16 bytes of x, one route and its weight) before anything waits. */
__global__ void ft_kio_publish_kernel(const uint16_t* __restrict__ x, int n_x, KioRoutes routes, uint16_t* dst_x,
                                      int32_t* dst_ids, float* dst_w, uint64_t* flags, int fault) {
    const uint64_t t_start = ft_now_ns();
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    const bool vec = (n_x % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(dst_x)) % 16 == 0);
    const uint4* src4 = reinterpret_cast<const uint4*>(x);
    const int n_vec = vec ? n_x / 8 : 0;
    const uint4 x_first = tid < n_vec ? src4[tid] : make_uint4(0, 0, 0, 0);
    const int n_routes = routes.tokens * routes.top_k;
    const int32_t route_first = tid < n_routes ? ft_cpu_route(routes, tid) : -1;
    const float w_first = tid < n_routes ? routes.w[tid] : 0.0f;
    uint64_t* ready = flags + FT_FLAG_READY_OFFSET / 8;
    uint64_t* done = flags + FT_FLAG_DONE_OFFSET / 8;
    int mine = 0;
    if (fault == FT_FAULT_NOFENCE) { /* injected: ready goes up before the stores, unfenced */
        mine = route_first >= 0 ? 1 : 0;
        for (int i = tid + nthreads; i < n_routes; i += nthreads) mine += ft_cpu_route(routes, i) >= 0 ? 1 : 0;
        if (__syncthreads_count(mine) == 0) {
            if (tid == 0) ft_volatile_store(done, FT_DONE_SKIPPED);
            return;
        }
        if (tid == 0) ft_volatile_store(ready, 1ull);
        mine = 0;
    }
    if (fault != FT_FAULT_STALE) {
        if (vec) {
            uint4* dst4 = reinterpret_cast<uint4*>(dst_x);
            for (int i = tid; i < n_vec; i += nthreads) dst4[i] = i == tid ? x_first : src4[i];
        } else {
            for (int i = tid; i < n_x; i += nthreads) dst_x[i] = x[i];
        }
    }
    for (int i = tid; i < n_routes; i += nthreads) {
        const int32_t route = i == tid ? route_first : ft_cpu_route(routes, i);
        mine += route >= 0 ? 1 : 0;
        dst_ids[i] = route;
        dst_w[i] = i == tid ? w_first : routes.w[i];
    }
    if (fault == FT_FAULT_NOFENCE) return;
    if (__syncthreads_count(mine) == 0) { /* empty-route skip: nothing for the CPU, do not wake it */
        if (tid == 0) ft_volatile_store(done, FT_DONE_SKIPPED);
        return;
    }
    if (tid == 0) { /* diagnostic stamps */
        ft_volatile_store(flags + FT_FLAG_GPU_PUBLISH_START_NS_OFFSET / 8, t_start);
        ft_volatile_store(flags + FT_FLAG_GPU_READY_NS_OFFSET / 8, ft_now_ns());
    }
    __threadfence_system(); /* this thread's stores reach host memory before ready */
    __syncthreads();
    if (tid == 0) ft_volatile_store(ready, 1ull);
}

/* One block. out: n BF16 values on the device; y: n values (BF16 or FP32) in mapped memory.
 * Every read of host memory is a bus round trip (~1.2 us on the H200 machine), and
 * reads of one address by many warps are served one after another, so: thread 0 alone
 * reads the flag words; each thread reads four consecutive y values per pass, and the
 * first pass's y reads are in flight together with thread 0's read of err. */
__global__ void ft_kio_combine_kernel(uint16_t* __restrict__ out, const void* y, int y_is_f32, int n,
                                      uint64_t* flags, uint64_t timeout_ns) {
    __shared__ uint64_t seen, err_seen;
    uint64_t* done = flags + FT_FLAG_DONE_OFFSET / 8;
    uint64_t* err = flags + FT_FLAG_ERR_OFFSET / 8;
    /* the GPU experts' output of this thread's first pass, loaded before the wait */
    const int i0 = 4 * static_cast<int>(threadIdx.x);
    float out_first[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) out_first[j] = i0 + j < n ? ft_bf16_to_float(out[i0 + j]) : 0.0f;
    if (threadIdx.x == 0) {
        seen = ft_spin_until_nonzero(done, timeout_ns);
        ft_volatile_store(flags + FT_FLAG_GPU_DONE_SEEN_NS_OFFSET / 8, ft_now_ns()); /* diagnostic */
        /* reset now: the posted write lands while y is read, so the fence at the end
         * finds nothing left to wait for (the next ready on this slot comes later) */
        ft_volatile_store(done, 0ull);
        if (seen == 0) ft_volatile_store(err, FT_ERR_WATCHDOG);
    }
    __syncthreads();
    if (seen == 1ull) {
        const int step = 4 * static_cast<int>(blockDim.x);
        const float4 first = ft_load_y4(y, y_is_f32, i0, n);
        if (threadIdx.x == 0) err_seen = ft_volatile_load(err);
        __syncthreads();
        if (err_seen == 0) {
            for (int i = i0; i < n; i += step) {
                const float4 v = i == i0 ? first : ft_load_y4(y, y_is_f32, i, n);
                const float add[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (i + j >= n) continue;
                    const float base = i == i0 ? out_first[j] : ft_bf16_to_float(out[i + j]);
                    out[i + j] = ft_float_to_bf16(base + add[j]);
                }
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ft_volatile_store(flags + FT_FLAG_GPU_Y_READ_NS_OFFSET / 8, ft_now_ns()); /* diagnostic */
        __threadfence_system();
    }
}

/* Threads for the combine kernel: four values each, whole warps, 64..1024. */
inline int ft_combine_threads(int n) {
    const int want = ((n + 3) / 4 + 31) / 32 * 32;
    return want < 64 ? 64 : (want > 1024 ? 1024 : want);
}

/* Threads for the publish kernel: eight BF16 values or one route each, whole warps, 64..512. */
inline int ft_publish_threads(int n_x, int n_routes) {
    int want = (n_x + 7) / 8;
    if (n_routes > want) want = n_routes;
    want = (want + 31) / 32 * 32;
    return want < 64 ? 64 : (want > 512 ? 512 : want);
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_HANDOFF_KERNELS_CUH */
