#include "pool.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <memory>
#include <stdexcept>

#include "fp_env.h"
#include "spin_pause.h"

namespace ft {

using Clock = std::chrono::steady_clock;

Pool::Pool(int num_threads, std::vector<int> cpus, double spin_us)
    : nthreads_(num_threads < 1 ? 1 : num_threads), cpus_(std::move(cpus)), spin_us_(spin_us) {
    threads_.reserve(nthreads_ - 1);
    for (int t = 1; t < nthreads_; ++t) {
        threads_.emplace_back([this, t] { worker_main(t); });
        // named before the constructor returns, for /proc/<pid>/task/*/comm (debuggers, the
        // leak tests); a name that does not take changes nothing else: not an error
        (void)pthread_setname_np(threads_.back().native_handle(), "ft-pool");
    }
}

Pool::~Pool() { close(); }

void Pool::close() {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (closed_.exchange(true)) return;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_.store(true);
    }
    cv_.notify_all();
    for (auto& th : threads_) th.join();
    threads_.clear();
}

void Pool::worker_main(int tid) {
    set_flush_denormals();  // this thread only ever runs the kernels
    if (!cpus_.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus_[tid % cpus_.size()], &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
    }
    uint64_t seen = 0;
    for (;;) {
        // spin for a while, then sleep until the next job
        auto t0 = Clock::now();
        uint32_t n = 0;
        while (gen_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
            cpu_pause();
            if ((++n & 63) != 0) continue;
            // let another thread on this CPU (the caller, on an oversubscribed machine) run
            std::this_thread::yield();
            if (std::chrono::duration<double, std::micro>(Clock::now() - t0).count() > spin_us_.load(std::memory_order_relaxed)) {
                std::unique_lock<std::mutex> lk(mu_);
                sleepers_.fetch_add(1);
                cv_.wait(lk, [&] { return gen_.load() != seen || stop_.load(); });
                sleepers_.fetch_sub(1);
                break;
            }
        }
        if (stop_.load()) return;
        seen = gen_.load(std::memory_order_acquire);
        try {
            (*job_)(tid);
        } catch (...) {
            std::lock_guard<std::mutex> lk(err_mu_);
            if (!err_) err_ = std::current_exception();
        }
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

void Pool::run(const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nthreads_ == 1) {
        fn(0);
        return;
    }
    err_ = nullptr;
    job_ = &fn;
    pending_.store(nthreads_ - 1, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
        { std::lock_guard<std::mutex> lk(mu_); }
        cv_.notify_all();
    }
    std::exception_ptr mine;
    try {
        fn(0);
    } catch (...) {
        mine = std::current_exception();
    }
    uint32_t n = 0;
    while (pending_.load(std::memory_order_acquire) != 0) {
        cpu_pause();
        if ((++n & 63) == 0) std::this_thread::yield();
    }
    job_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (err_) {
        std::exception_ptr e = err_;
        err_ = nullptr;
        std::rethrow_exception(e);
    }
}

void Pool::parallel_for(int nitems, const std::function<void(int, int)>& fn) {
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nitems <= 0) return;
    if (nitems == 1 || nthreads_ == 1) {
        for (int i = 0; i < nitems; ++i) fn(i, 0);
        return;
    }
    std::atomic<int> next{0};
    std::function<void(int)> body = [&](int tid) {
        for (;;) {
            int i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= nitems) break;
            fn(i, tid);
        }
    };
    run(body);
}

void Pool::run_phases(const std::vector<Phase>& phases) {
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nthreads_ == 1) {
        for (const auto& ph : phases)
            for (int i = 0; i < ph.nitems; ++i) ph.fn(i, 0);
        return;
    }
    const size_t np = phases.size();
    std::unique_ptr<std::atomic<int>[]> next(new std::atomic<int>[np]);
    std::unique_ptr<std::atomic<int>[]> arrived(new std::atomic<int>[np]);
    for (size_t p = 0; p < np; ++p) {
        next[p].store(0);
        arrived[p].store(0);
    }
    std::atomic<bool> failed{false};
    const int nt = nthreads_;
    std::function<void(int)> body = [&](int tid) {
        std::exception_ptr mine;
        for (size_t p = 0; p < np; ++p) {
            const Phase& ph = phases[p];
            if (!failed.load(std::memory_order_relaxed)) {
                try {
                    for (;;) {
                        const int i = next[p].fetch_add(1, std::memory_order_relaxed);
                        if (i >= ph.nitems) break;
                        ph.fn(i, tid);
                    }
                } catch (...) {
                    if (!mine) mine = std::current_exception();
                    failed.store(true);
                }
            }
            if (p + 1 == np) break;  // the last phase needs no barrier: run() joins
            arrived[p].fetch_add(1, std::memory_order_acq_rel);
            uint32_t spins = 0;
            while (arrived[p].load(std::memory_order_acquire) < nt) {
                cpu_pause();
                if ((++spins & 63) == 0) std::this_thread::yield();
            }
        }
        if (mine) std::rethrow_exception(mine);
    };
    run(body);
}

}  // namespace ft
