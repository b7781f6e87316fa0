// The GPU's side of the hand-off protocol played by a host thread, for measuring
// the coordinator without a GPU: raise ready, wait for done, reset done.
#pragma once

#include <cstdint>
#include <vector>

#include "pool.h"

namespace ft {

// For each round, for each descriptor in order: release-store ready = 1, spin until
// done != 0, store done = 0. Returns the ns from each ready store to done seen.
// Throws std::runtime_error when a hand-off takes longer than timeout_ms or reports err.
std::vector<uint64_t> drive_handoffs(const std::vector<uint64_t>& descs, int rounds, double timeout_ms);

// run_task on each descriptor in order, rounds times, from this thread; ns per call.
std::vector<uint64_t> time_run_task(const std::vector<uint64_t>& descs, int rounds, Pool& pool);

}  // namespace ft
