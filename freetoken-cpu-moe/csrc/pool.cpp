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

namespace {

constexpr uint64_t kGateOpen = 1ull << 31, kGateCount = kGateOpen - 1;

uint64_t gate_tag(uint64_t gen) { return (gen & 0xffffffffull) << 32; }

// Spin until done() holds, letting another thread on this CPU run now and then.
template <class Done>
void spin_until(Done done) {
    uint32_t n = 0;
    while (!done()) {
        cpu_pause();
        if ((++n & 63) == 0) std::this_thread::yield();
    }
}

// The first exception of an item job; later items are skipped once one failed.
struct ItemErrors {
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::exception_ptr first;

    void run(const std::function<void(int, int)>& fn, int item, int tid) {
        if (failed.load(std::memory_order_relaxed)) return;
        try {
            fn(item, tid);
        } catch (...) {
            std::lock_guard<std::mutex> lk(mu);
            if (!first) first = std::current_exception();
            failed.store(true);
        }
    }
    void rethrow() {
        if (first) std::rethrow_exception(first);
    }
};

}  // namespace

void Pool::inject_worker_delay(int tid, double ms) {
    delay_ms_.store(ms);
    delay_tid_.store(tid);
}

bool Pool::enter(uint64_t gen) {
    uint64_t s = gate_.load(std::memory_order_acquire);
    for (;;) {
        if ((s & ~(kGateOpen | kGateCount)) != gate_tag(gen) || !(s & kGateOpen)) return false;
        if (gate_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    }
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
        if (delay_tid_.load(std::memory_order_relaxed) == tid && delay_tid_.exchange(0) == tid)
            std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay_ms_.load()));
        // a job whose gate closed (its items done without this worker) or that a newer
        // one replaced is skipped; the loop then sees the newer one, if any
        if (!enter(seen)) continue;
        const bool every = every_worker_;
        try {
            (*job_)(tid);
        } catch (...) {
            std::lock_guard<std::mutex> lk(err_mu_);
            if (!err_) err_ = std::current_exception();
        }
        if (every) pending_.fetch_sub(1, std::memory_order_acq_rel);
        gate_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

void Pool::dispatch(const std::function<void(int)>& fn, bool every_worker, const std::function<void()>& settle) {
    err_ = nullptr;
    job_ = &fn;
    every_worker_ = every_worker;
    pending_.store(every_worker ? nthreads_ - 1 : 0, std::memory_order_relaxed);
    const uint64_t gen = gen_.load(std::memory_order_relaxed) + 1;
    gate_.store(gate_tag(gen) | kGateOpen, std::memory_order_release);
    gen_.store(gen, std::memory_order_seq_cst);
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
    if (every_worker) spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    else settle();
    // no worker joins from now on; wait for those inside to leave
    gate_.fetch_and(~kGateOpen, std::memory_order_acq_rel);
    spin_until([&] { return (gate_.load(std::memory_order_acquire) & kGateCount) == 0; });
    job_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (err_) {
        std::exception_ptr e = err_;
        err_ = nullptr;
        std::rethrow_exception(e);
    }
}

void Pool::run(const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nthreads_ == 1) {
        fn(0);
        return;
    }
    dispatch(fn, true, [] {});
}

void Pool::parallel_for(int nitems, const std::function<void(int, int)>& fn) {
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nitems <= 0) return;
    if (nitems == 1 || nthreads_ == 1) {
        for (int i = 0; i < nitems; ++i) fn(i, 0);
        return;
    }
    std::atomic<int> next{0}, done{0};
    ItemErrors errors;
    std::function<void(int)> body = [&](int tid) {
        for (;;) {
            const int i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= nitems) break;
            errors.run(fn, i, tid);
            done.fetch_add(1, std::memory_order_release);
        }
    };
    {
        std::lock_guard<std::mutex> run_lock(run_mu_);
        if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
        dispatch(body, false, [&] { spin_until([&] { return done.load(std::memory_order_acquire) >= nitems; }); });
    }
    errors.rethrow();
}

void Pool::run_phases(const std::vector<Phase>& phases) {
    if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
    if (nthreads_ == 1) {
        for (const auto& ph : phases)
            for (int i = 0; i < ph.nitems; ++i) ph.fn(i, 0);
        return;
    }
    const size_t np = phases.size();
    if (np == 0) return;
    std::unique_ptr<std::atomic<int>[]> next(new std::atomic<int>[np]);
    std::unique_ptr<std::atomic<int>[]> done(new std::atomic<int>[np]);
    for (size_t p = 0; p < np; ++p) {
        next[p].store(0);
        done[p].store(0);
    }
    ItemErrors errors;
    auto phase_done = [&](size_t p) { return done[p].load(std::memory_order_acquire) >= phases[p].nitems; };
    // a worker that joins late finds the earlier phases' items handed out and done, and
    // passes their barriers at once; the barriers count items, not workers
    std::function<void(int)> body = [&](int tid) {
        for (size_t p = 0; p < np; ++p) {
            const Phase& ph = phases[p];
            for (;;) {
                const int i = next[p].fetch_add(1, std::memory_order_relaxed);
                if (i >= ph.nitems) break;
                errors.run(ph.fn, i, tid);
                done[p].fetch_add(1, std::memory_order_release);
            }
            if (p + 1 == np) break;  // the caller waits for the last phase (settle)
            spin_until([&] { return phase_done(p); });
        }
    };
    {
        std::lock_guard<std::mutex> run_lock(run_mu_);
        if (closed_.load()) throw std::runtime_error("freetoken_cpu_moe: the worker pool is closed");
        dispatch(body, false, [&] { spin_until([&] { return phase_done(np - 1); }); });
    }
    errors.rethrow();
}

}  // namespace ft
