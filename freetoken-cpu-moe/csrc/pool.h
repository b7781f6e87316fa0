// Persistent worker pool: threads created once, woken per job, the calling
// thread takes part as worker 0. Workers spin briefly after a job (decode
// steps arrive back to back) and then sleep on a condition variable.
//
// Item jobs (parallel_for, run_phases) end when their last item is done, not when
// every worker has come by: a worker that the OS has not scheduled in time (its core
// lent to another thread) is not waited for. Workers join a job through a gate that
// the caller closes once the items are done; it then waits only for the workers
// inside, so none of them touches the job's memory after the call returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ft {

class Pool {
public:
    // num_threads workers in total (the caller is one of them); cpus: where to
    // pin workers 1..n-1 (cpus[i % size]); empty = no pinning.
    Pool(int num_threads, std::vector<int> cpus, double spin_us);
    ~Pool();
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    int num_threads() const { return nthreads_; }
    // How long idle workers spin before sleeping (microseconds); changed between jobs
    // by the owner of the cores (e.g. 0 while torch's threads run a prompt's dense ops).
    double spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
    void set_spin_us(double us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
    // CPUs the workers are pinned to (cpus()[t] for worker t >= 1); empty = unpinned.
    // cpus()[0] is left for the calling thread (the coordinator pins itself there).
    const std::vector<int>& cpus() const { return cpus_; }
    // Run fn(tid) on every worker (tid 0 = the caller) and wait for all.
    // Callers are serialised; the first exception thrown by any worker is rethrown.
    void run(const std::function<void(int)>& fn);
    // Dynamic split: fn(item, tid) for item in [0, nitems), items handed out in order;
    // returns when every item is done. The first exception is rethrown after the items
    // already handed out are done; the items after it are skipped.
    void parallel_for(int nitems, const std::function<void(int, int)>& fn);
    // Several parallel_for phases in one wake-up, separated by barriers: phase p+1
    // starts after every item of phase p is done. An exception skips the rest.
    struct Phase {
        int nitems;
        std::function<void(int, int)> fn;
    };
    void run_phases(const std::vector<Phase>& phases);
    void close();
    bool closed() const { return closed_.load(); }
    // Test hook: worker tid (>= 1) sleeps ms after it sees the next job, before it
    // joins it (a worker whose core the OS gave to another thread).
    void inject_worker_delay(int tid, double ms);

private:
    void worker_main(int tid);
    // Publish fn to the workers and run it as worker 0. every_worker: wait until each
    // worker ran fn once; else run settle() (which returns when the job's items are
    // done), close the gate and wait for the workers inside. The caller holds run_mu_.
    void dispatch(const std::function<void(int)>& fn, bool every_worker, const std::function<void()>& settle);
    bool enter(uint64_t gen);

    int nthreads_;
    std::vector<int> cpus_;
    std::atomic<double> spin_us_;
    std::vector<std::thread> threads_;
    std::mutex run_mu_;
    const std::function<void(int)>* job_ = nullptr;
    bool every_worker_ = false;
    std::atomic<uint64_t> gen_{0};
    // The gate of the current job: its generation's low 32 bits in bits 32-63, bit 31
    // while workers may join, bits 0-30 how many are inside.
    std::atomic<uint64_t> gate_{0};
    std::atomic<int> delay_tid_{0};
    std::atomic<double> delay_ms_{0.0};
    std::atomic<int> pending_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<bool> stop_{false};
    std::atomic<bool> closed_{false};
    std::mutex mu_;
    std::condition_variable cv_;
    std::mutex err_mu_;
    std::exception_ptr err_;
};

}  // namespace ft
