// One step of a spin-wait: the CPU's pause hint (x86: PAUSE, which also keeps a
// spinning hyper-thread from starving its sibling), else a yield.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#include <thread>
#endif

namespace ft {

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

}  // namespace ft
