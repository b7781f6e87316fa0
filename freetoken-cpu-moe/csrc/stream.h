// A multi-threaded streaming read: the memory-bandwidth ceiling the bench compares against.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"
#include "pool.h"

namespace ft {

// Every pool worker reads a contiguous share of [p, p + n) with the tier's widest loads.
uint64_t stream_read(const uint8_t* p, size_t n, Pool& pool, const KernelTable& k);

}  // namespace ft
