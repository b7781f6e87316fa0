// The hand-off coordinator: one thread polls the flag slots of its tasks and
// serves them (ready -> run -> y -> seq++ -> done), a second thread is the
// watchdog that fails a task whose `ready` stays up unserved past the bound.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "pool.h"

namespace ft {

struct CoordinatorStats {
    uint64_t served = 0, errors = 0, watchdog_fired = 0, sleeps = 0;
    uint64_t busy_ns = 0;  // time from claiming a task to releasing done, summed
};

// One served hand-off as the poll thread saw it (steady_clock ns, CLOCK_MONOTONIC
// on Linux, the clock of Python's time.monotonic_ns()).
struct ServeRecord {
    uint64_t desc = 0;      // descriptor address
    uint64_t claim_ns = 0;  // ready seen and claimed
    uint64_t run_ns = 0;    // task computed (y written)
    uint64_t done_ns = 0;   // done released
    // the slot's diagnostic GPU clock stamps at claim (KernelIO only, else 0): this
    // hand-off's publish (kernel entry, before its fence), and of the previous hand-off
    // on this slot when the GPU saw done and when it had read y
    uint64_t gpu_publish_start_ns = 0, gpu_ready_ns = 0, gpu_prev_done_seen_ns = 0, gpu_prev_y_read_ns = 0;
};

class Coordinator {
public:
    Coordinator(std::shared_ptr<Pool> pool, double watchdog_ms, double spin_us);
    ~Coordinator();
    void add_task(uint64_t desc);
    // After return the coordinator no longer reads the task's memory.
    void remove_task(uint64_t desc);
    void start();
    void stop();
    bool running() const { return running_.load(); }
    size_t num_tasks();
    CoordinatorStats stats() const;
    // Stage trace: record the next kTraceCapacity served hand-offs (clears the previous
    // record; waits for the poll thread to take the request when it is running).
    static constexpr size_t kTraceCapacity = 16384, kTraceWords = 8;
    void trace_start();
    std::vector<ServeRecord> trace() const;
    // Test hooks: stall the poll loop once for ms; make the next served task throw.
    void inject_stall_ms(double ms) { stall_ms_.store(ms); }
    void inject_fault() { fault_.store(true); }

private:
    void loop_main();
    void watchdog_main();
    void wait_seen(uint64_t version);

    std::shared_ptr<Pool> pool_;
    double watchdog_ms_, spin_us_;
    std::mutex tasks_mu_;
    std::vector<uint64_t> tasks_;
    std::atomic<uint64_t> version_{0};
    std::atomic<uint64_t> loop_seen_{0}, wd_seen_{0};
    std::atomic<bool> running_{false}, stop_{false};
    std::thread loop_, watchdog_;
    std::mutex wd_mu_;
    std::condition_variable wd_cv_;
    std::mutex loop_mu_;
    std::condition_variable loop_cv_;
    std::atomic<double> stall_ms_{0.0};
    std::atomic<bool> fault_{false};
    std::atomic<uint64_t> served_{0}, errors_{0}, watchdog_fired_{0}, sleeps_{0}, busy_ns_{0};
    // trace: written only by the poll thread; entries are atomics so a concurrent reader is safe
    std::unique_ptr<std::atomic<uint64_t>[]> trace_{new std::atomic<uint64_t>[kTraceWords * kTraceCapacity]()};
    std::atomic<size_t> trace_len_{0};
    std::atomic<bool> trace_reset_{false}, trace_on_{false};
    std::mutex lifecycle_mu_;
};

}  // namespace ft
