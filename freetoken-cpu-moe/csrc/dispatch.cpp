#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// AMX tiles (INT8 and BF16) and AVX512-BF16, and the kernel's permission to use the
// tile data state: Linux hands it out per process on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction
// faults. Asked once; a refusal (old kernel, a sandbox) leaves the tier out.
bool cpu_has_amx() {
#if defined(__x86_64__) && defined(__linux__)
    static const bool ok = [] {
        if (!cpu_has_avx512()) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool tiles = (d >> 24 & 1) && (d >> 25 & 1) && (d >> 22 & 1);  // AMX-TILE, AMX-INT8, AMX-BF16
        if (!tiles || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;  // AVX512-BF16
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
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

// AVX-VNNI (the VEX-encoded 256-bit vpdpbusd, e.g. of Intel Core 12th gen and later;
// CPUID leaf 7 subleaf 1, EAX bit 4) on top of the avx2 tier's AVX2 + FMA + F16C. It needs
// no register state beyond AVX2's YMM, which cpu_has_avx2 has checked the OS saves.
bool cpu_has_avx_vnni() {
#if defined(__x86_64__)
    static const bool ok = [] {
        if (!cpu_has_avx2()) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || a < 1) return false;  // a: the last subleaf of leaf 7
        return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
    }();
    return ok;
#else
    return false;
#endif
}

bool cpu_has_vbmi() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
#else
    return false;
#endif
}

std::atomic<bool>& vbmi_slot() {
    static std::atomic<bool> on{cpu_has_vbmi()};
    return on;
}

int tier_rank(const std::string& name) {
    const auto& order = tier_order();
    for (size_t i = 0; i < order.size(); ++i)
        if (order[i] == name) return (int)i;
    return -1;
}

// The tiers this CPU supports, best first, whatever the cap.
std::vector<std::string> cpu_tiers() {
    std::vector<std::string> out;
    if (cpu_has_amx()) out.push_back("amx");
    if (cpu_has_avx512()) out.push_back("avx512");
    if (cpu_has_avx_vnni()) out.push_back("avx_vnni");
    if (cpu_has_avx2()) out.push_back("avx2");
    out.push_back("scalar");
    return out;
}

const KernelTable* initial_kernels() { return kernels_by_name(isa_tiers().front()); }

std::atomic<const KernelTable*>& active_slot() {
    static std::atomic<const KernelTable*> slot{initial_kernels()};
    return slot;
}

}  // namespace

// Every tier by capability, best first: a cap keeps the tiers at or below it.
const std::vector<std::string>& tier_order() {
    static const std::vector<std::string> order = {"amx", "avx512", "avx_vnni", "avx2", "scalar"};
    return order;
}


// FREETOKEN_CPU_MOE_ISA, read once: the tiers above the named one are left out, as on a
// processor without them (an unknown name caps nothing; the Python package warns).
std::vector<std::string> isa_tiers() {
    static const std::vector<std::string> tiers = [] {
        std::vector<std::string> all = cpu_tiers();
        const char* env = std::getenv("FREETOKEN_CPU_MOE_ISA");
        const int cap = env ? tier_rank(env) : -1;
        if (cap < 0) return all;
        std::vector<std::string> kept;
        for (const auto& t : all)
            if (tier_rank(t) >= cap) kept.push_back(t);
        return kept;
    }();
    return tiers;
}

const KernelTable* kernels_by_name(const std::string& name) {
    if (name == "amx") return kernels_amx();
    if (name == "avx512") return kernels_avx512();
    if (name == "avx_vnni") return kernels_avx_vnni();
    if (name == "avx2") return kernels_avx2();
    if (name == "scalar") return kernels_scalar();
    throw std::invalid_argument("unknown ISA tier '" + name + "' (expected amx, avx512, avx_vnni, avx2 or scalar)");
}

bool mxfp4_vbmi() { return vbmi_slot().load(std::memory_order_relaxed); }

bool set_mxfp4_vbmi(bool on) {
    if (on && !cpu_has_vbmi()) throw std::invalid_argument("this CPU has no AVX512-VBMI");
    return vbmi_slot().exchange(on);
}

const KernelTable* active_kernels() { return active_slot().load(std::memory_order_acquire); }

void set_active_isa(const std::string& name) {
    const KernelTable* k = kernels_by_name(name);
    for (const auto& t : isa_tiers())
        if (t == name) {
            active_slot().store(k, std::memory_order_release);
            return;
        }
    const char* cap = std::getenv("FREETOKEN_CPU_MOE_ISA");
    throw std::invalid_argument("ISA tier '" + name + "' is not supported by this CPU" +
                                (cap && *cap ? std::string(" or is above FREETOKEN_CPU_MOE_ISA=") + cap : std::string()));
}

}  // namespace ft
