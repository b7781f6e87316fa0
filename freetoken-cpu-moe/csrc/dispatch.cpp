#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace ft {
namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

const KernelTable* initial_kernels() {
    std::vector<std::string> tiers = isa_tiers();
    const char* env = std::getenv("FREETOKEN_CPU_MOE_ISA");
    if (env && *env) {
        std::string want(env);
        for (const auto& t : tiers)
            if (t == want) return kernels_by_name(want);
        // unknown or unsupported: fall through to the best tier (Python warns)
    }
    return kernels_by_name(tiers.front());
}

std::atomic<const KernelTable*>& active_slot() {
    static std::atomic<const KernelTable*> slot{initial_kernels()};
    return slot;
}

}  // namespace

std::vector<std::string> isa_tiers() {
    std::vector<std::string> out;
    if (cpu_has_avx512()) out.push_back("avx512");
    if (cpu_has_avx2()) out.push_back("avx2");
    out.push_back("scalar");
    return out;
}

const KernelTable* kernels_by_name(const std::string& name) {
    if (name == "avx512") return kernels_avx512();
    if (name == "avx2") return kernels_avx2();
    if (name == "scalar") return kernels_scalar();
    throw std::invalid_argument("unknown ISA tier '" + name + "' (expected avx512, avx2 or scalar)");
}

const KernelTable* active_kernels() { return active_slot().load(std::memory_order_acquire); }

void set_active_isa(const std::string& name) {
    const KernelTable* k = kernels_by_name(name);
    for (const auto& t : isa_tiers())
        if (t == name) {
            active_slot().store(k, std::memory_order_release);
            return;
        }
    throw std::invalid_argument("ISA tier '" + name + "' is not supported by this CPU");
}

}  // namespace ft
