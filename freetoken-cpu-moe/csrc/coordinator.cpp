#include "coordinator.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "dispatch.h"
#include "moe.h"
#include "spin_pause.h"

namespace ft {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t now_ns() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

ft_flag_slot* slot_of(uint64_t desc) {
    return (ft_flag_slot*)(uintptr_t)((const ft_task_desc*)(uintptr_t)desc)->flag_slot;
}

// Finish a hand-off: publish err (if any), count it, release done.
void complete(ft_flag_slot* s, uint64_t err) {
    if (err) __atomic_store_n(&s->err, err, __ATOMIC_RELAXED);
    __atomic_fetch_add(&s->seq, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
}

// Claim a raised ready flag (ready 1 -> 0); false if someone else took it.
bool claim(ft_flag_slot* s) {
    uint64_t expected = 1;
    return __atomic_compare_exchange_n(&s->ready, &expected, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

}  // namespace

Coordinator::Coordinator(std::shared_ptr<Pool> pool, double watchdog_ms, double spin_us)
    : pool_(std::move(pool)), watchdog_ms_(watchdog_ms), spin_us_(spin_us) {
    if (!pool_) throw std::invalid_argument("Coordinator: pool is required");
    if (!(watchdog_ms > 0)) throw std::invalid_argument("Coordinator: watchdog_ms must be > 0");
}

Coordinator::~Coordinator() { stop(); }

void Coordinator::add_task(uint64_t desc) {
    if (!desc) throw std::invalid_argument("Coordinator.add_task: null descriptor address");
    const ft_task_desc* d = (const ft_task_desc*)(uintptr_t)desc;
    if (d->abi_version != FT_HANDOFF_ABI_VERSION)
        throw std::invalid_argument("Coordinator.add_task: descriptor abi_version " + std::to_string(d->abi_version) +
                                    " != " + std::to_string(FT_HANDOFF_ABI_VERSION));
    if (!d->flag_slot) throw std::invalid_argument("Coordinator.add_task: descriptor has no flag slot");
    {
        std::lock_guard<std::mutex> lk(tasks_mu_);
        if (std::find(tasks_.begin(), tasks_.end(), desc) != tasks_.end()) return;
        tasks_.push_back(desc);
        version_.fetch_add(1);
    }
    loop_cv_.notify_all();
}

void Coordinator::remove_task(uint64_t desc) {
    uint64_t v;
    {
        std::lock_guard<std::mutex> lk(tasks_mu_);
        auto it = std::find(tasks_.begin(), tasks_.end(), desc);
        if (it == tasks_.end()) return;
        tasks_.erase(it);
        v = version_.fetch_add(1) + 1;
    }
    wait_seen(v);
}

void Coordinator::wait_seen(uint64_t v) {
    // Both threads pick up a new task list only between sweeps, so once both have
    // seen version v neither holds a pointer into a removed task.
    loop_cv_.notify_all();
    wd_cv_.notify_all();
    while (running_.load() && (loop_seen_.load() < v || wd_seen_.load() < v)) {
        loop_cv_.notify_all();
        wd_cv_.notify_all();
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

size_t Coordinator::num_tasks() {
    std::lock_guard<std::mutex> lk(tasks_mu_);
    return tasks_.size();
}

CoordinatorStats Coordinator::stats() const {
    CoordinatorStats s;
    s.served = served_.load();
    s.errors = errors_.load();
    s.watchdog_fired = watchdog_fired_.load();
    s.sleeps = sleeps_.load();
    s.busy_ns = busy_ns_.load();
    return s;
}

void Coordinator::trace_start() {
    trace_on_.store(true);
    trace_reset_.store(true);
    while (running_.load() && trace_reset_.load()) std::this_thread::sleep_for(std::chrono::microseconds(20));
    if (trace_reset_.exchange(false)) trace_len_.store(0);  // not running: nobody else takes it
}

std::vector<ServeRecord> Coordinator::trace() const {
    const size_t n = trace_len_.load(std::memory_order_acquire);
    std::vector<ServeRecord> out(n);
    for (size_t i = 0; i < n; ++i) {
        const std::atomic<uint64_t>* e = &trace_[kTraceWords * i];
        out[i].desc = e[0].load(std::memory_order_relaxed);
        out[i].claim_ns = e[1].load(std::memory_order_relaxed);
        out[i].run_ns = e[2].load(std::memory_order_relaxed);
        out[i].done_ns = e[3].load(std::memory_order_relaxed);
        out[i].gpu_publish_start_ns = e[4].load(std::memory_order_relaxed);
        out[i].gpu_ready_ns = e[5].load(std::memory_order_relaxed);
        out[i].gpu_prev_done_seen_ns = e[6].load(std::memory_order_relaxed);
        out[i].gpu_prev_y_read_ns = e[7].load(std::memory_order_relaxed);
    }
    return out;
}

void Coordinator::start() {
    std::lock_guard<std::mutex> lk(lifecycle_mu_);
    if (running_.load()) return;
    if (pool_->closed()) throw std::runtime_error("Coordinator.start: the worker pool is closed");
    stop_.store(false);
    loop_seen_.store(0);
    wd_seen_.store(0);
    running_.store(true);
    loop_ = std::thread([this] { loop_main(); });
    watchdog_ = std::thread([this] { watchdog_main(); });
    (void)pthread_setname_np(loop_.native_handle(), "ft-coordinator");  // as the pool's workers (pool.cpp)
    (void)pthread_setname_np(watchdog_.native_handle(), "ft-watchdog");
}

void Coordinator::stop() {
    std::lock_guard<std::mutex> lk(lifecycle_mu_);
    if (!running_.load()) return;
    {
        std::lock_guard<std::mutex> l1(loop_mu_);
        std::lock_guard<std::mutex> l2(wd_mu_);
        stop_.store(true);
    }
    loop_cv_.notify_all();
    wd_cv_.notify_all();
    loop_.join();
    watchdog_.join();
    running_.store(false);
}

void Coordinator::loop_main() {
    // the polling thread is the pool's worker 0: pin it to the CPU the pool leaves free
    if (!pool_->cpus().empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(pool_->cpus()[0], &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
    }
    std::vector<uint64_t> local;
    uint64_t have = ~(uint64_t)0;
    auto last_work = Clock::now();
    double backoff_us = 20.0;
    uint32_t idle_sweeps = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
        const uint64_t v = version_.load();
        if (v != have) {
            std::lock_guard<std::mutex> lk(tasks_mu_);
            local = tasks_;
            have = version_.load();
        }
        loop_seen_.store(have);
        if (trace_reset_.load(std::memory_order_relaxed)) {
            trace_len_.store(0);
            trace_reset_.store(false);
        }
        const double stall = stall_ms_.exchange(0.0);
        if (stall > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(stall));
        bool worked = false;
        for (uint64_t desc : local) {
            ft_flag_slot* s = slot_of(desc);
            if (__atomic_load_n(&s->ready, __ATOMIC_ACQUIRE) != 1) continue;
            if (!claim(s)) continue;  // the watchdog got it first
            const uint64_t t_claim = now_ns();
            const uint64_t g_start = __atomic_load_n(&s->gpu_publish_start_ns, __ATOMIC_RELAXED);
            const uint64_t g_ready = __atomic_load_n(&s->gpu_ready_ns, __ATOMIC_RELAXED);
            const uint64_t g_prev_seen = __atomic_load_n(&s->gpu_done_seen_ns, __ATOMIC_RELAXED);
            const uint64_t g_prev_y = __atomic_load_n(&s->gpu_y_read_ns, __ATOMIC_RELAXED);
            uint64_t err = FT_ERR_NONE;
            try {
                if (fault_.exchange(false)) throw std::runtime_error("injected fault");
                run_task((const ft_task_desc*)(uintptr_t)desc, *pool_, *active_kernels());
            } catch (const BadTask&) {
                err = FT_ERR_BAD_TASK;
            } catch (...) {
                err = FT_ERR_CPU_EXCEPTION;
            }
            const uint64_t t_run = now_ns();
            complete(s, err);
            const uint64_t t_done = now_ns();
            busy_ns_.fetch_add(t_done - t_claim, std::memory_order_relaxed);
            const size_t n = trace_len_.load(std::memory_order_relaxed);
            if (trace_on_.load(std::memory_order_relaxed) && n < kTraceCapacity) {
                std::atomic<uint64_t>* e = &trace_[kTraceWords * n];
                const uint64_t words[kTraceWords] = {desc, t_claim, t_run, t_done, g_start, g_ready, g_prev_seen, g_prev_y};
                for (size_t j = 0; j < kTraceWords; ++j) e[j].store(words[j], std::memory_order_relaxed);
                trace_len_.store(n + 1, std::memory_order_release);
            }
            served_.fetch_add(1, std::memory_order_relaxed);
            if (err) errors_.fetch_add(1, std::memory_order_relaxed);
            worked = true;
        }
        const auto now = Clock::now();
        if (worked) {
            last_work = now;
            backoff_us = 20.0;
            continue;
        }
        if (std::chrono::duration<double, std::micro>(now - last_work).count() < spin_us_) {
            // a short pause between sweeps: a raised flag is seen within ~0.1 us
            for (int i = 0; i < 2; ++i) cpu_pause();
            if ((++idle_sweeps & 63) == 0) std::this_thread::yield();  // share the CPU if oversubscribed
            continue;
        }
        // idle: sleep, growing the interval up to 1 ms (an idle server burns no core)
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        std::unique_lock<std::mutex> lk(loop_mu_);
        loop_cv_.wait_for(lk, std::chrono::duration<double, std::micro>(backoff_us), [&] {
            return stop_.load() || version_.load() != have;
        });
        backoff_us = std::min(backoff_us * 2.0, 1000.0);
    }
    loop_seen_.store(~(uint64_t)0 >> 1);
}

void Coordinator::watchdog_main() {
    struct Track {
        uint64_t desc;
        bool pending;
        uint64_t seq;
        Clock::time_point since;
    };
    std::vector<Track> track;
    uint64_t have = ~(uint64_t)0;
    const double period_ms = std::max(0.05, std::min(watchdog_ms_ / 4.0, 10.0));
    while (!stop_.load()) {
        const uint64_t v = version_.load();
        if (v != have) {
            std::lock_guard<std::mutex> lk(tasks_mu_);
            std::vector<Track> nt;
            for (uint64_t d : tasks_) {
                Track t{d, false, 0, Clock::now()};
                for (const auto& o : track)
                    if (o.desc == d) t = o;
                nt.push_back(t);
            }
            track.swap(nt);
            have = version_.load();
        }
        wd_seen_.store(have);
        const auto now = Clock::now();
        for (auto& t : track) {
            ft_flag_slot* s = slot_of(t.desc);
            const uint64_t ready = __atomic_load_n(&s->ready, __ATOMIC_ACQUIRE);
            const uint64_t seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
            if (ready != 1) {
                t.pending = false;
                continue;
            }
            if (!t.pending || t.seq != seq) {
                t.pending = true;
                t.seq = seq;
                t.since = now;
                continue;
            }
            if (std::chrono::duration<double, std::milli>(now - t.since).count() > watchdog_ms_ && claim(s)) {
                complete(s, FT_ERR_WATCHDOG);
                watchdog_fired_.fetch_add(1, std::memory_order_relaxed);
                t.pending = false;
            }
        }
        std::unique_lock<std::mutex> lk(wd_mu_);
        wd_cv_.wait_for(lk, std::chrono::duration<double, std::milli>(period_ms), [&] {
            return stop_.load() || version_.load() != have;
        });
    }
    wd_seen_.store(~(uint64_t)0 >> 1);
}

}  // namespace ft
