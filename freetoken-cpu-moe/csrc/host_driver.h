// The GPU's side of the hand-off protocol played by a host thread, for measuring
// the coordinator without a GPU: raise ready, wait for done, reset done.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "pool.h"

namespace ft {

// For each round, for each descriptor in order: release-store ready = 1, spin until
// done != 0, store done = 0. Returns the ns from each ready store to done seen.
// Throws std::runtime_error when a hand-off takes longer than timeout_ms or reports err.
std::vector<uint64_t> drive_handoffs(const std::vector<uint64_t>& descs, int rounds, double timeout_ms);

// run_task on each descriptor in order, rounds times, from this thread; ns per call.
std::vector<uint64_t> time_run_task(const std::vector<uint64_t>& descs, int rounds, Pool& pool);

// One kernel, this thread only: for each round, dot_rows over every row of every
// expert of w against T activations x (float32 [T][w.cols], prepared once) with the
// tier's kernels. Returns the ns per round.
std::vector<uint64_t> time_dot_rows(const ft_weight_desc& w, const float* x, uint32_t T, int rounds,
                                    const KernelTable& k);

}  // namespace ft
