/*
 * FreeToken GPU host-side runtime code, shared by freetoken-cuda and freetoken-rocm:
 * device/runtime queries, capability probes, pinned/mapped host memory, stream memops
 * (native or as explicit graph nodes), host callbacks and kernel launches.
 * Every runtime/driver call is checked; failures throw with the call named.
 * Addresses and stream handles come in as integers (no libtorch).
 */
#ifndef FREETOKEN_GPU_RUNTIME_HOST_CUH
#define FREETOKEN_GPU_RUNTIME_HOST_CUH

#include <freetoken/gpu/handoff_kernels.cuh>

#include <atomic>
#include <cstring>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace freetoken_gpu {

inline ftStream_t as_stream(uint64_t handle) { return reinterpret_cast<ftStream_t>(handle); }

/* ---- queries -------------------------------------------------------------- */
struct DeviceInfo {
    std::string name;
    std::string arch; /* "sm_90" / "gfx1030" */
    int major = 0, minor = 0;
    uint64_t total_memory = 0;
    int multiprocessors = 0;
    int can_map_host_memory = 0;
    int unified_addressing = 0;
    int pageable_memory_access = 0;
    bool memops = false;
    std::string memops_reason;
    int memops_v1_attr = -1; /* CUDA: CAN_USE_STREAM_MEM_OPS_V1 (informational) */
};

inline int device_count() {
    int n = 0;
    FT_CHECK(ftGetDeviceCount(&n));
    return n;
}

inline DeviceInfo device_info(int device) {
    DeviceInfo d;
    ftDeviceProp p;
    FT_CHECK(ftGetDeviceProperties(&p, device));
    d.name = p.name;
    d.major = p.major;
    d.minor = p.minor;
    d.total_memory = p.totalGlobalMem;
    d.multiprocessors = p.multiProcessorCount;
#ifdef FT_GPU_HIP
    d.arch = p.gcnArchName;
#else
    d.arch = "sm_" + std::to_string(p.major) + std::to_string(p.minor);
#endif
    FT_CHECK(ftDeviceGetAttribute(&d.can_map_host_memory, ftDevAttrCanMapHostMemory, device));
    FT_CHECK(ftDeviceGetAttribute(&d.unified_addressing, ftDevAttrUnifiedAddressing, device));
    FT_CHECK(ftDeviceGetAttribute(&d.pageable_memory_access, ftDevAttrPageableMemoryAccess, device));
    MemopSupport m = memop_support(device);
    d.memops = m.available;
    d.memops_reason = m.reason;
#ifndef FT_GPU_HIP
    if (driver_api().get_attribute) {
        int v1 = 0;
        if (driver_api().get_attribute(&v1, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, device) == CUDA_SUCCESS)
            d.memops_v1_attr = v1;
    }
#endif
    return d;
}

inline int runtime_version() {
    int v = 0;
    FT_CHECK(ftRuntimeGetVersion(&v));
    return v;
}

inline int driver_version() {
    int v = 0;
    FT_CHECK(ftDriverGetVersion(&v));
    return v;
}

/* ---- host memory ------------------------------------------------------------ */
struct HostAllocation {
    uint64_t host = 0;
    uint64_t device = 0;
};

inline HostAllocation host_alloc(size_t nbytes, bool mapped) {
    HostAllocation a;
    void* p = nullptr;
    unsigned flags = ftHostAllocPortable | (mapped ? ftHostAllocMapped : 0u);
    FT_CHECK(ftHostAlloc(&p, nbytes, flags));
    a.host = reinterpret_cast<uint64_t>(p);
    if (mapped) {
        void* d = nullptr;
        ftError_t e = ftHostGetDevicePointer(&d, p, 0);
        if (e != ftSuccess) {
            (void)ftFreeHost(p);
            ft_check(e, "ftHostGetDevicePointer(mapped host allocation)", __FILE__, __LINE__);
        }
        a.device = reinterpret_cast<uint64_t>(d);
    }
    return a;
}

inline void host_free(uint64_t host) { FT_CHECK(ftFreeHost(reinterpret_cast<void*>(host))); }

inline uint64_t host_register(uint64_t ptr, size_t nbytes, bool mapped, bool read_only) {
    unsigned flags = ftHostRegisterPortable | (mapped ? ftHostRegisterMapped : 0u) |
                     (read_only ? static_cast<unsigned>(ftHostRegisterReadOnly) : 0u);
    FT_CHECK(ftHostRegister(reinterpret_cast<void*>(ptr), nbytes, flags));
    if (!mapped) return 0;
    void* d = nullptr;
    FT_CHECK(ftHostGetDevicePointer(&d, reinterpret_cast<void*>(ptr), 0));
    return reinterpret_cast<uint64_t>(d);
}

inline void host_unregister(uint64_t ptr) { FT_CHECK(ftHostUnregister(reinterpret_cast<void*>(ptr))); }

/* ---- graph capture state ------------------------------------------------------ */
inline bool stream_is_capturing(uint64_t stream) {
    ftStreamCaptureStatus st;
    FT_CHECK(ftStreamIsCapturing(as_stream(stream), &st));
    return st == ftStreamCaptureStatusActive;
}

/* ---- flag kernels (publish/wait without memops; HIP's explicit graph nodes) ---- */
inline void launch_flag_write(uint64_t stream, uint64_t dev_addr, uint64_t value) {
    ft_flag_write_kernel<<<1, 1, 0, as_stream(stream)>>>(reinterpret_cast<uint64_t*>(dev_addr), value);
    FT_CHECK_LAUNCH("ft_flag_write_kernel<<<>>>");
}

inline void launch_flag_wait(uint64_t stream, uint64_t dev_addr, uint64_t value, uint64_t reset, uint64_t err_addr,
                             uint64_t timeout_ns) {
    ft_flag_wait_kernel<<<1, 1, 0, as_stream(stream)>>>(reinterpret_cast<uint64_t*>(dev_addr), value, reset,
                                                        reinterpret_cast<uint64_t*>(err_addr), timeout_ns);
    FT_CHECK_LAUNCH("ft_flag_wait_kernel<<<>>>");
}

/* ---- memops: natively on the stream, or as an explicit node of the capture graph ---- */
/* Bound on the wait of an explicit flag-kernel node (the CPU watchdog fires long before). */
#define FT_EXPLICIT_WAIT_TIMEOUT_NS 10000000000ull
#ifndef FT_GPU_HIP
/* Append one batch-memop node to the graph the stream is capturing into, after the
 * stream's current capture dependencies, and make it the new dependency. */
inline void capture_memop_node(uint64_t stream, uint64_t dev_addr, uint64_t value, bool is_wait, uint64_t) {
    const DriverApi& api = driver_api();
    if (!api.add_memop_node || !api.ctx_get_current)
        throw std::runtime_error("explicit memop graph nodes need cuGraphAddBatchMemOpNode/cuCtxGetCurrent: " +
                                 api.error);
    cudaStreamCaptureStatus status;
    cudaGraph_t graph = nullptr;
    const cudaGraphNode_t* deps = nullptr;
    size_t ndeps = 0;
#if CUDART_VERSION >= 13000
    FT_CHECK(cudaStreamGetCaptureInfo(as_stream(stream), &status, nullptr, &graph, &deps, nullptr, &ndeps));
#else
    FT_CHECK(cudaStreamGetCaptureInfo_v2(as_stream(stream), &status, nullptr, &graph, &deps, &ndeps));
#endif
    if (status != cudaStreamCaptureStatusActive) throw std::runtime_error("capture_memop_node: stream is not capturing");
    CUstreamBatchMemOpParams op;
    memset(&op, 0, sizeof(op));
    if (is_wait) {
        op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        op.waitValue.address = static_cast<CUdeviceptr>(dev_addr);
        op.waitValue.value64 = value;
        op.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
    } else {
        op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        op.writeValue.address = static_cast<CUdeviceptr>(dev_addr);
        op.writeValue.value64 = value;
        op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    CUDA_BATCH_MEM_OP_NODE_PARAMS params;
    memset(&params, 0, sizeof(params));
    FT_CU_CHECK(api.ctx_get_current(&params.ctx));
    params.count = 1;
    params.paramArray = &op;
    params.flags = 0;
    std::vector<CUgraphNode> dep_copy(deps, deps + ndeps);
    CUgraphNode node = nullptr;
    FT_CU_CHECK(api.add_memop_node(&node, reinterpret_cast<CUgraph>(graph), dep_copy.data(), dep_copy.size(), &params));
    cudaGraphNode_t new_dep = reinterpret_cast<cudaGraphNode_t>(node);
#if CUDART_VERSION >= 13000
    FT_CHECK(cudaStreamUpdateCaptureDependencies(as_stream(stream), &new_dep, nullptr, 1, cudaStreamSetCaptureDependencies));
#else
    FT_CHECK(cudaStreamUpdateCaptureDependencies(as_stream(stream), &new_dep, 1, cudaStreamSetCaptureDependencies));
#endif
}
#else
/* HIP has no memop graph node: the explicit node is a one-thread flag kernel, which stream
 * capture records as a kernel node like any launch. A write is a system fence and a store
 * (ft_flag_write_kernel); a wait spins until the word equals the value and leaves it as it
 * is (the caller's next write resets it), bounded, with err = FT_ERR_WATCHDOG on timeout
 * when err_addr is given. */
inline void capture_memop_node(uint64_t stream, uint64_t dev_addr, uint64_t value, bool is_wait, uint64_t err_addr) {
    if (!stream_is_capturing(stream)) throw std::runtime_error("capture_memop_node: stream is not capturing");
    if (is_wait)
        launch_flag_wait(stream, dev_addr, value, value, err_addr, FT_EXPLICIT_WAIT_TIMEOUT_NS);
    else
        launch_flag_write(stream, dev_addr, value);
}
#endif

/* explicit: add the memop as an explicit graph node when the stream is capturing. */
inline void memop_write(uint64_t stream, uint64_t dev_addr, uint64_t value, bool explicit_node) {
    if (explicit_node && stream_is_capturing(stream)) return capture_memop_node(stream, dev_addr, value, false, 0);
    stream_write_value64(as_stream(stream), dev_addr, value);
}

/* err_addr (optional, 0: none) is the slot's err word an explicit HIP wait node reports a timeout in. */
inline void memop_wait(uint64_t stream, uint64_t dev_addr, uint64_t value, bool explicit_node, uint64_t err_addr = 0) {
    if (explicit_node && stream_is_capturing(stream))
        return capture_memop_node(stream, dev_addr, value, true, err_addr);
    stream_wait_value64_eq(as_stream(stream), dev_addr, value);
}

/* ---- release events: the HIP copy path's barrier between D2H copies and ready ----- */
struct EventSupport {
    bool compiled = false;  /* this build can record events as graph nodes */
    bool available = false; /* ... and the runtime did it: eager record, captured node, replay */
    std::string reason;     /* why not, when not */
};

#ifdef FT_GPU_HIP
inline uint64_t release_event_create() {
    hipEvent_t e = nullptr;
    FT_CHECK(hipEventCreateWithFlags(&e, hipEventDisableTiming | hipEventReleaseToSystem));
    return reinterpret_cast<uint64_t>(e);
}

inline void release_event_destroy(uint64_t event) { FT_CHECK(ftEventDestroy(reinterpret_cast<ftEvent_t>(event))); }

/* Eagerly a plain record (the event's own flag makes its release system-wide); under
 * capture with hipEventRecordExternal, so the graph keeps it as an event-record node that
 * every replay runs between the copies before it and the ready write after it. */
inline void release_event_record(uint64_t stream, uint64_t event) {
#if FT_HIP_EVENT_RECORD_WITH_FLAGS
    hipEvent_t e = reinterpret_cast<hipEvent_t>(event);
    if (stream_is_capturing(stream))
        FT_CHECK(hipEventRecordWithFlags(e, as_stream(stream), hipEventRecordExternal));
    else
        FT_CHECK(ftEventRecord(e, as_stream(stream)));
#else
    (void)stream;
    (void)event;
    throw std::runtime_error("freetoken_rocm was built without hipEventRecordWithFlags (HIP " +
                             std::to_string(HIP_VERSION_MAJOR) + "." + std::to_string(HIP_VERSION_MINOR) +
                             "): the event-ordered copy path is unavailable");
#endif
}

/* Record the event eagerly, then capture one external record on a private stream and
 * check the graph holds an event-record node and replays. Throws nothing. */
inline EventSupport event_support() {
    EventSupport r;
#if FT_HIP_EVENT_RECORD_WITH_FLAGS
    r.compiled = true;
    ftStream_t s = nullptr;
    uint64_t ev = 0;
    ftGraph_t g = nullptr;
    ftGraphExec_t ge = nullptr;
    try {
        FT_CHECK(ftStreamCreateWithFlags(&s, ftStreamNonBlocking));
        ev = release_event_create();
        release_event_record(reinterpret_cast<uint64_t>(s), ev);
        FT_CHECK(ftStreamSynchronize(s));
        FT_CHECK(ftStreamBeginCapture(s, ftStreamCaptureModeThreadLocal));
        ftError_t rec = hipEventRecordWithFlags(reinterpret_cast<hipEvent_t>(ev), s, hipEventRecordExternal);
        FT_CHECK(ftStreamEndCapture(s, &g));
        FT_CHECK(rec);
        size_t n = 0;
        FT_CHECK(ftGraphGetNodes(g, nullptr, &n));
        std::vector<ftGraphNode_t> nodes(n);
        if (n) FT_CHECK(ftGraphGetNodes(g, nodes.data(), &n));
        int records = 0;
        for (size_t i = 0; i < n; ++i) {
            ftGraphNodeType t;
            FT_CHECK(ftGraphNodeGetType(nodes[i], &t));
            if (t == hipGraphNodeTypeEventRecord) ++records;
        }
        if (records < 1) throw std::runtime_error("the captured graph has no event-record node");
        FT_CHECK(ftGraphInstantiateNoFlags(&ge, g));
        FT_CHECK(ftGraphLaunch(ge, s));
        FT_CHECK(ftStreamSynchronize(s));
        r.available = true;
    } catch (const std::exception& e) {
        r.reason = std::string("release event check failed: ") + e.what();
    }
    if (ge) (void)ftGraphExecDestroy(ge);
    if (g) (void)ftGraphDestroy(g);
    if (ev) (void)ftEventDestroy(reinterpret_cast<ftEvent_t>(ev));
    if (s) (void)ftStreamDestroy(s);
#else
    r.reason = "built without hipEventRecordWithFlags (HIP " + std::to_string(HIP_VERSION_MAJOR) + "." +
               std::to_string(HIP_VERSION_MINOR) + " headers): rebuild freetoken-rocm against a ROCm that has it";
#endif
    return r;
}
#else
/* CUDA: the stream write of the copy path is ordered after earlier copies by the driver. */
inline uint64_t release_event_create() {
    throw std::runtime_error("release events are the HIP copy path's; CUDA does not use them");
}
inline void release_event_destroy(uint64_t) {
    throw std::runtime_error("release events are the HIP copy path's; CUDA does not use them");
}
inline void release_event_record(uint64_t, uint64_t) {
    throw std::runtime_error("release events are the HIP copy path's; CUDA does not use them");
}
inline EventSupport event_support() {
    EventSupport r;
    r.reason = "not used with CUDA: its stream write is ordered after earlier copies";
    return r;
}
#endif

/* ---- kernels ---------------------------------------------------------------- */
inline void kio_publish(uint64_t stream, uint64_t x, uint64_t ids, bool ids_are_64, uint64_t w, int n_x, int tokens,
                        int top_k, uint64_t cpu_mask, uint64_t resident, int cpu_last_n, uint64_t dst_x, uint64_t dst_ids,
                        uint64_t dst_w, uint64_t flags, int fault) {
    KioRoutes r;
    r.ids = reinterpret_cast<const void*>(ids);
    r.ids_are_64 = ids_are_64 ? 1 : 0;
    r.w = reinterpret_cast<const float*>(w);
    r.tokens = tokens;
    r.top_k = top_k;
    r.cpu_mask = reinterpret_cast<const uint8_t*>(cpu_mask);
    r.resident = reinterpret_cast<const uint8_t*>(resident);
    r.cpu_last_n = cpu_last_n;
    ft_kio_publish_kernel<<<1, ft_publish_threads(n_x, tokens * top_k), 0, as_stream(stream)>>>(
        reinterpret_cast<const uint16_t*>(x), n_x, r, reinterpret_cast<uint16_t*>(dst_x),
        reinterpret_cast<int32_t*>(dst_ids), reinterpret_cast<float*>(dst_w), reinterpret_cast<uint64_t*>(flags), fault);
    FT_CHECK_LAUNCH("ft_kio_publish_kernel<<<>>>");
}

inline void kio_combine(uint64_t stream, uint64_t out, uint64_t y, bool y_is_f32, int n, uint64_t flags,
                        uint64_t timeout_ns) {
    ft_kio_combine_kernel<<<1, ft_combine_threads(n), 0, as_stream(stream)>>>(reinterpret_cast<uint16_t*>(out),
                                                             reinterpret_cast<const void*>(y), y_is_f32 ? 1 : 0, n,
                                                             reinterpret_cast<uint64_t*>(flags), timeout_ns);
    FT_CHECK_LAUNCH("ft_kio_combine_kernel<<<>>>");
}

/* ---- host callbacks (eager only) --------------------------------------------- */
struct HostWaitCtx {
    uint64_t* slot;
    uint64_t timeout_ns;
};

inline void host_publish_fn(void* slot) {
    auto* ready = reinterpret_cast<uint64_t*>(slot) + FT_FLAG_READY_OFFSET / 8;
    __atomic_store_n(ready, 1ull, __ATOMIC_RELEASE);
}

inline void host_wait_fn(void* arg) {
    HostWaitCtx ctx = *reinterpret_cast<HostWaitCtx*>(arg);
    delete reinterpret_cast<HostWaitCtx*>(arg);
    uint64_t* done = ctx.slot + FT_FLAG_DONE_OFFSET / 8;
    uint64_t* err = ctx.slot + FT_FLAG_ERR_OFFSET / 8;
    auto start = std::chrono::steady_clock::now();
    uint64_t spins = 0;
    while (__atomic_load_n(done, __ATOMIC_ACQUIRE) == 0) {
        if (++spins % 1024 == 0) {
            auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
            if (static_cast<uint64_t>(ns.count()) > ctx.timeout_ns) {
                __atomic_store_n(err, static_cast<uint64_t>(FT_ERR_WATCHDOG), __ATOMIC_RELEASE);
                break;
            }
            std::this_thread::yield();
        }
    }
    __atomic_store_n(done, 0ull, __ATOMIC_RELEASE);
}

inline void host_callback_publish(uint64_t stream, uint64_t slot_host) {
    if (stream_is_capturing(stream))
        throw std::runtime_error("host-callback hand-off is eager only: refusing to capture it into a graph");
    FT_CHECK(ftLaunchHostFunc(as_stream(stream), host_publish_fn, reinterpret_cast<void*>(slot_host)));
}

inline void host_callback_wait(uint64_t stream, uint64_t slot_host, uint64_t timeout_ns) {
    if (stream_is_capturing(stream))
        throw std::runtime_error("host-callback hand-off is eager only: refusing to capture it into a graph");
    auto* ctx = new HostWaitCtx{reinterpret_cast<uint64_t*>(slot_host), timeout_ns};
    ftError_t e = ftLaunchHostFunc(as_stream(stream), host_wait_fn, ctx);
    if (e != ftSuccess) delete ctx;
    ft_check(e, "ftLaunchHostFunc(host_wait_fn)", __FILE__, __LINE__);
}

/* Enqueue a host function on a private stream and wait for it: do host callbacks run here? */
inline void host_probe_fn(void* word) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(word), 0x5EEDull, __ATOMIC_RELEASE);
}

inline std::string host_callback_probe() {
    uint64_t word = 0;
    ftStream_t s = nullptr;
    std::string error;
    try {
        FT_CHECK(ftStreamCreateWithFlags(&s, ftStreamNonBlocking));
        FT_CHECK(ftLaunchHostFunc(s, host_probe_fn, &word));
        FT_CHECK(ftStreamSynchronize(s));
        if (__atomic_load_n(&word, __ATOMIC_ACQUIRE) != 0x5EEDull) error = "the host function did not run";
    } catch (const std::exception& e) {
        error = e.what();
    }
    if (s) (void)ftStreamDestroy(s);
    return error;
}

/* ---- does stream capture record memops natively? ------------------------------- */
struct GraphMemopProbe {
    bool capture_ok = false;
    bool flag_unchanged_during_capture = false;
    int nodes = 0;
    int memop_nodes = 0;
    bool replay_performed = false;
    bool native = false;
    bool explicit_ok = false;
    std::string error;          /* the native capture's error, else the explicit one's */
    std::string explicit_error; /* the explicit-node capture's error */
};

struct CapturedMemops {
    bool unchanged = false; /* the word kept its value while capturing */
    int nodes = 0;
    int memop_nodes = 0;    /* CUDA: batch-memop nodes; HIP (no such type): every node */
    bool performed = false; /* the replay wrote the last value */
};

/* Capture "write 7; wait 7; write 9" on s, then replay it once. Throws on API errors. */
inline CapturedMemops capture_memops_once(ftStream_t s, volatile uint64_t* word, uint64_t dev_addr,
                                          bool explicit_node) {
    CapturedMemops c;
    *word = 0;
    ftGraph_t g = nullptr;
    ftGraphExec_t ge = nullptr;
    const uint64_t sh = reinterpret_cast<uint64_t>(s);
    FT_CHECK(ftStreamBeginCapture(s, ftStreamCaptureModeThreadLocal));
    try {
        memop_write(sh, dev_addr, 7, explicit_node);
        memop_wait(sh, dev_addr, 7, explicit_node);
        memop_write(sh, dev_addr, 9, explicit_node);
    } catch (...) {
        (void)ftStreamEndCapture(s, &g);
        if (g) (void)ftGraphDestroy(g);
        throw;
    }
    FT_CHECK(ftStreamEndCapture(s, &g));
    try {
        c.unchanged = *word == 0;
        size_t n = 0;
        FT_CHECK(ftGraphGetNodes(g, nullptr, &n));
        std::vector<ftGraphNode_t> nodes(n);
        if (n) FT_CHECK(ftGraphGetNodes(g, nodes.data(), &n));
        c.nodes = static_cast<int>(n);
        for (size_t i = 0; i < n; ++i) {
#ifndef FT_GPU_HIP
            if (!driver_api().node_get_type) throw std::runtime_error("cuGraphNodeGetType unavailable");
            CUgraphNodeType t;
            FT_CU_CHECK(driver_api().node_get_type(reinterpret_cast<CUgraphNode>(nodes[i]), &t));
            if (t == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) ++c.memop_nodes;
#else
            ftGraphNodeType t;
            FT_CHECK(ftGraphNodeGetType(nodes[i], &t));
            ++c.memop_nodes;
#endif
        }
        FT_CHECK(ftGraphInstantiateNoFlags(&ge, g));
        FT_CHECK(ftGraphLaunch(ge, s));
        FT_CHECK(ftStreamSynchronize(s));
        c.performed = *word == 9;
    } catch (...) {
        if (ge) (void)ftGraphExecDestroy(ge);
        (void)ftGraphDestroy(g);
        throw;
    }
    FT_CHECK(ftGraphExecDestroy(ge));
    FT_CHECK(ftGraphDestroy(g));
    return c;
}

/* Native capture: the memops are graph nodes when the word did not change while capturing
 * (a runtime that runs them at capture time changes it) and the replay performs them (one
 * that leaves them out of the graph does not). Explicit nodes (CUDA: batch-memop nodes;
 * HIP: flag kernels) are checked the same way. Throws nothing: errors land in .error. */
inline GraphMemopProbe probe_graph_memops(uint64_t host_addr, uint64_t dev_addr) {
    GraphMemopProbe r;
    volatile uint64_t* word = reinterpret_cast<volatile uint64_t*>(host_addr);
    ftStream_t s = nullptr;
    try {
        FT_CHECK(ftStreamCreateWithFlags(&s, ftStreamNonBlocking));
    } catch (const std::exception& e) {
        r.error = e.what();
        return r;
    }
    try {
        CapturedMemops c = capture_memops_once(s, word, dev_addr, false);
        r.capture_ok = true;
        r.flag_unchanged_during_capture = c.unchanged;
        r.nodes = c.nodes;
        r.memop_nodes = c.memop_nodes;
        r.replay_performed = c.performed;
        r.native = c.unchanged && c.memop_nodes >= 3 && c.performed;
    } catch (const std::exception& e) {
        r.error = e.what();
    }
    try {
        CapturedMemops c = capture_memops_once(s, word, dev_addr, true);
        r.explicit_ok = c.unchanged && c.memop_nodes >= 3 && c.performed;
    } catch (const std::exception& e) {
        r.explicit_error = e.what();
        if (r.error.empty()) r.error = r.explicit_error;
    }
    *word = 0;
    (void)ftStreamSynchronize(s);
    (void)ftStreamDestroy(s);
    return r;
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_RUNTIME_HOST_CUH */
