#include "stream.h"

#include <atomic>

namespace ft {

uint64_t stream_read(const uint8_t* p, size_t n, Pool& pool, const KernelTable& k) {
    const int nt = pool.num_threads();
    const size_t share = ((n / (size_t)nt) + 63) & ~(size_t)63;
    std::atomic<uint64_t> sum{0};
    pool.run([&](int tid) {
        const size_t b = (size_t)tid * share;
        if (b >= n) return;
        size_t len = n - b < share ? n - b : share;
        len &= ~(size_t)63;
        sum.fetch_add(k.stream(p + b, len), std::memory_order_relaxed);
    });
    return sum.load();
}

}  // namespace ft
