#include "host_driver.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "dispatch.h"
#include "fp_env.h"
#include "moe.h"
#include "spin_pause.h"

namespace ft {
namespace {

using Clock = std::chrono::steady_clock;

ft_flag_slot* slot_of(uint64_t desc) {
    if (!desc) throw std::invalid_argument("drive_handoffs: null descriptor address");
    const ft_task_desc* d = (const ft_task_desc*)(uintptr_t)desc;
    if (!d->flag_slot) throw std::invalid_argument("drive_handoffs: descriptor has no flag slot");
    return (ft_flag_slot*)(uintptr_t)d->flag_slot;
}

}  // namespace

std::vector<uint64_t> drive_handoffs(const std::vector<uint64_t>& descs, int rounds, double timeout_ms) {
    std::vector<ft_flag_slot*> slots;
    for (uint64_t d : descs) slots.push_back(slot_of(d));
    std::vector<uint64_t> out;
    out.reserve((size_t)rounds * slots.size());
    const auto limit = std::chrono::duration<double, std::milli>(timeout_ms);
    for (int r = 0; r < rounds; ++r) {
        for (size_t i = 0; i < slots.size(); ++i) {
            ft_flag_slot* s = slots[i];
            const auto t0 = Clock::now();
            __atomic_store_n(&s->ready, 1, __ATOMIC_RELEASE);
            uint32_t n = 0;
            while (__atomic_load_n(&s->done, __ATOMIC_ACQUIRE) == 0) {
                cpu_pause();
                if ((++n & 1023) == 0 && Clock::now() - t0 > limit)
                    throw std::runtime_error("drive_handoffs: task " + std::to_string(i) + " not done after " +
                                             std::to_string(timeout_ms) + " ms (is a coordinator serving it?)");
            }
            const auto t1 = Clock::now();
            __atomic_store_n(&s->done, 0, __ATOMIC_RELAXED);
            const uint64_t err = __atomic_load_n(&s->err, __ATOMIC_ACQUIRE);
            if (err) throw std::runtime_error("drive_handoffs: task " + std::to_string(i) + " failed with err " +
                                              std::to_string(err));
            out.push_back((uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
        }
    }
    return out;
}

std::vector<uint64_t> time_run_task(const std::vector<uint64_t>& descs, int rounds, Pool& pool) {
    const KernelTable& k = *active_kernels();
    std::vector<uint64_t> out;
    out.reserve((size_t)rounds * descs.size());
    for (int r = 0; r < rounds; ++r) {
        for (uint64_t d : descs) {
            const auto t0 = Clock::now();
            run_task((const ft_task_desc*)(uintptr_t)d, pool, k);
            out.push_back((uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
        }
    }
    return out;
}

std::vector<uint64_t> time_dot_rows(const ft_weight_desc& w, const float* x, uint32_t T, int rounds,
                                    const KernelTable& k) {
    FlushDenormalsScope ftz;
    validate_weight(w, "time_dot_rows");
    const ActKind kind = act_kind_for(w.format);
    const size_t xb = act_bytes(kind, w.cols);
    std::vector<uint8_t> xq((size_t)T * xb + 64);
    uint8_t* xa = (uint8_t*)(((uintptr_t)xq.data() + 63) & ~(uintptr_t)63);
    std::vector<const void*> xs(T);
    for (uint32_t t = 0; t < T; ++t) {
        k.prepare(kind, x + (size_t)t * w.cols, w.cols, xa + (size_t)t * xb);
        xs[t] = xa + (size_t)t * xb;
    }
    std::vector<float> y((size_t)T * w.rows);
    std::vector<uint64_t> out;
    out.reserve((size_t)rounds);
    for (int r = 0; r < rounds; ++r) {
        const auto t0 = Clock::now();
        for (uint32_t e = 0; e < w.num_experts; ++e) k.dot_rows(w, e, 0, w.rows, xs.data(), T, y.data(), w.rows);
        out.push_back((uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
    }
    return out;
}

}  // namespace ft
