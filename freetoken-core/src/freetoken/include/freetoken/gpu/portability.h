/*
 * FreeToken GPU portability layer: the one place where CUDA and HIP names differ.
 *
 * freetoken-cuda (nvcc) and freetoken-rocm (hipcc, HIP_PLATFORM=amd) both include this
 * header and the shared device/host code next to it (handoff_kernels.cuh,
 * runtime_host.cuh, module_bindings.cuh); neither package carries a copy of that code. Define
 * FT_GPU_HIP (freetoken-rocm's build does) to select HIP, else CUDA is used.
 *
 * Besides plain renames (ftStream_t, ftMemcpyAsync, ...), three things differ in kind:
 *  - stream memory operations: CUDA has them only in the driver API, so they are
 *    resolved at run time (cudaGetDriverEntryPointByVersion; no link to libcuda);
 *    HIP has them in its runtime (hipStreamWriteValue64 / hipStreamWaitValue64).
 *  - the capability attributes that say whether memops work on this device.
 *  - HIP's stream write does not promise CUDA's system fence before the write, so the
 *    HIP copy path records a system-release event between its copies and the ready
 *    write. Recording it as a node of a captured graph needs hipEventRecordWithFlags
 *    (hipEventRecordExternal), which older HIP runtimes (5.2 among them) lack: the
 *    build defines FT_HIP_EVENT_RECORD_WITH_FLAGS to 1 where the compiler's HIP has it,
 *    else the event path is compiled out and reported unavailable.
 * Errors: FT_CHECK(call) throws std::runtime_error naming the call and the error.
 */
#ifndef FREETOKEN_GPU_PORTABILITY_H
#define FREETOKEN_GPU_PORTABILITY_H

#include <stdint.h>

#include <stdexcept>
#include <string>

#ifdef FT_GPU_HIP
#include <hip/hip_runtime.h>
#define FT_GPU_API_NAME "hip"
typedef hipError_t ftError_t;
typedef hipStream_t ftStream_t;
typedef hipGraph_t ftGraph_t;
typedef hipGraphExec_t ftGraphExec_t;
typedef hipGraphNode_t ftGraphNode_t;
typedef hipGraphNodeType ftGraphNodeType;
typedef hipStreamCaptureStatus ftStreamCaptureStatus;
typedef hipDeviceProp_t ftDeviceProp;
#define ftSuccess hipSuccess
#define ftGetErrorString hipGetErrorString
#define ftGetLastError hipGetLastError
#define ftGetDeviceCount hipGetDeviceCount
#define ftGetDevice hipGetDevice
#define ftSetDevice hipSetDevice
#define ftGetDeviceProperties hipGetDeviceProperties
#define ftDeviceGetAttribute hipDeviceGetAttribute
#define ftDevAttrCanMapHostMemory hipDeviceAttributeCanMapHostMemory
#define ftDevAttrUnifiedAddressing hipDeviceAttributeUnifiedAddressing
#define ftDevAttrConcurrentManagedAccess hipDeviceAttributeConcurrentManagedAccess
#define ftDevAttrPageableMemoryAccess hipDeviceAttributePageableMemoryAccess
#define ftDriverGetVersion hipDriverGetVersion
#define ftRuntimeGetVersion hipRuntimeGetVersion
#define ftHostAlloc hipHostMalloc
/* fine-grained (coherent) memory: the GPU spins on flags the CPU writes, and vice versa */
#define ftHostAllocMapped (hipHostMallocMapped | hipHostMallocCoherent)
#define ftHostAllocPortable hipHostMallocPortable
#define ftHostAllocDefault hipHostMallocDefault
#define ftFreeHost hipHostFree
#define ftHostGetDevicePointer hipHostGetDevicePointer
#define ftHostRegister hipHostRegister
#define ftHostRegisterMapped hipHostRegisterMapped
#define ftHostRegisterPortable hipHostRegisterPortable
/* read-only registration (file mappings opened read-only); HIP runtimes before it existed
 * register without the flag, which such memory may then refuse */
#if defined(hipHostRegisterReadOnly) || (defined(HIP_VERSION) && HIP_VERSION >= 60000000)
#define ftHostRegisterReadOnly hipHostRegisterReadOnly
#else
#define ftHostRegisterReadOnly 0u
#endif
#define ftHostUnregister hipHostUnregister
#define ftMalloc hipMalloc
#define ftFree hipFree
#define ftMemcpy hipMemcpy
#define ftMemcpyAsync hipMemcpyAsync
#define ftMemcpyDefault hipMemcpyDefault
#define ftMemcpyHostToDevice hipMemcpyHostToDevice
#define ftMemcpyDeviceToHost hipMemcpyDeviceToHost
#define ftStreamCreateWithFlags hipStreamCreateWithFlags
#define ftStreamNonBlocking hipStreamNonBlocking
#define ftStreamDestroy hipStreamDestroy
#define ftStreamSynchronize hipStreamSynchronize
#define ftDeviceSynchronize hipDeviceSynchronize
#define ftStreamBeginCapture hipStreamBeginCapture
#define ftStreamEndCapture hipStreamEndCapture
#define ftStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define ftStreamIsCapturing hipStreamIsCapturing
#define ftStreamCaptureStatusActive hipStreamCaptureStatusActive
#define ftGraphGetNodes hipGraphGetNodes
#define ftGraphNodeGetType hipGraphNodeGetType
#define ftGraphDestroy hipGraphDestroy
#define ftGraphExecDestroy hipGraphExecDestroy
#define ftGraphLaunch hipGraphLaunch
#define ftGraphInstantiateNoFlags(exec, graph) hipGraphInstantiate((exec), (graph), nullptr, nullptr, 0)
typedef hipEvent_t ftEvent_t;
#define ftEventDestroy hipEventDestroy
#define ftEventRecord hipEventRecord
#ifndef FT_HIP_EVENT_RECORD_WITH_FLAGS
#define FT_HIP_EVENT_RECORD_WITH_FLAGS 0
#endif
#define FT_RUNTIME_VERSION_COMPILED HIP_VERSION
#else
#include <cuda.h> /* driver types and enums only: libcuda is resolved at run time */
#include <cuda_runtime.h>
#define FT_GPU_API_NAME "cuda"
typedef cudaError_t ftError_t;
typedef cudaStream_t ftStream_t;
typedef cudaGraph_t ftGraph_t;
typedef cudaGraphExec_t ftGraphExec_t;
typedef cudaGraphNode_t ftGraphNode_t;
typedef cudaGraphNodeType ftGraphNodeType;
typedef cudaStreamCaptureStatus ftStreamCaptureStatus;
typedef cudaDeviceProp ftDeviceProp;
#define ftSuccess cudaSuccess
#define ftGetErrorString cudaGetErrorString
#define ftGetLastError cudaGetLastError
#define ftGetDeviceCount cudaGetDeviceCount
#define ftGetDevice cudaGetDevice
#define ftSetDevice cudaSetDevice
#define ftGetDeviceProperties cudaGetDeviceProperties
#define ftDeviceGetAttribute cudaDeviceGetAttribute
#define ftDevAttrCanMapHostMemory cudaDevAttrCanMapHostMemory
#define ftDevAttrUnifiedAddressing cudaDevAttrUnifiedAddressing
#define ftDevAttrConcurrentManagedAccess cudaDevAttrConcurrentManagedAccess
#define ftDevAttrPageableMemoryAccess cudaDevAttrPageableMemoryAccess
#define ftDriverGetVersion cudaDriverGetVersion
#define ftRuntimeGetVersion cudaRuntimeGetVersion
#define ftHostAlloc cudaHostAlloc
#define ftHostAllocMapped cudaHostAllocMapped
#define ftHostAllocPortable cudaHostAllocPortable
#define ftHostAllocDefault cudaHostAllocDefault
#define ftFreeHost cudaFreeHost
#define ftHostGetDevicePointer cudaHostGetDevicePointer
#define ftHostRegister cudaHostRegister
#define ftHostRegisterMapped cudaHostRegisterMapped
#define ftHostRegisterPortable cudaHostRegisterPortable
#define ftHostRegisterReadOnly cudaHostRegisterReadOnly
#define ftHostUnregister cudaHostUnregister
#define ftMalloc cudaMalloc
#define ftFree cudaFree
#define ftMemcpy cudaMemcpy
#define ftMemcpyAsync cudaMemcpyAsync
#define ftMemcpyDefault cudaMemcpyDefault
#define ftMemcpyHostToDevice cudaMemcpyHostToDevice
#define ftMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define ftStreamCreateWithFlags cudaStreamCreateWithFlags
#define ftStreamNonBlocking cudaStreamNonBlocking
#define ftStreamDestroy cudaStreamDestroy
#define ftStreamSynchronize cudaStreamSynchronize
#define ftDeviceSynchronize cudaDeviceSynchronize
#define ftLaunchHostFunc cudaLaunchHostFunc
#define ftStreamBeginCapture cudaStreamBeginCapture
#define ftStreamEndCapture cudaStreamEndCapture
#define ftStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define ftStreamIsCapturing cudaStreamIsCapturing
#define ftStreamCaptureStatusActive cudaStreamCaptureStatusActive
#define ftGraphGetNodes cudaGraphGetNodes
#define ftGraphNodeGetType cudaGraphNodeGetType
#define ftGraphDestroy cudaGraphDestroy
#define ftGraphExecDestroy cudaGraphExecDestroy
#define ftGraphLaunch cudaGraphLaunch
#define ftGraphInstantiateNoFlags(exec, graph) cudaGraphInstantiate((exec), (graph), 0)
#define FT_RUNTIME_VERSION_COMPILED CUDART_VERSION
#endif

namespace freetoken_gpu {

#ifdef FT_GPU_HIP
/* HIP 5.x declares hipLaunchHostFunc but its runtime does not export it: host
 * functions go through hipStreamAddCallback with a trampoline instead. */
typedef void (*ft_host_fn)(void*);
struct HostFnTrampoline {
    ft_host_fn fn;
    void* arg;
};
inline void ft_host_fn_trampoline(hipStream_t, hipError_t, void* p) {
    HostFnTrampoline t = *static_cast<HostFnTrampoline*>(p);
    delete static_cast<HostFnTrampoline*>(p);
    t.fn(t.arg);
}
inline hipError_t ftLaunchHostFunc(hipStream_t stream, ft_host_fn fn, void* arg) {
    auto* t = new HostFnTrampoline{fn, arg};
    hipError_t e = hipStreamAddCallback(stream, ft_host_fn_trampoline, t, 0);
    if (e != hipSuccess) delete t;
    return e;
}
#endif

/* Throw with the failing call's text and the runtime's error name. */
inline void ft_check(ftError_t err, const char* call, const char* file, int line) {
    if (err != ftSuccess) {
        (void)ftGetLastError(); /* clear it, so a later launch check does not report it again */
        throw std::runtime_error(std::string(FT_GPU_API_NAME) + " call failed: " + call + " -> " +
                                 ftGetErrorString(err) + " (" + file + ":" + std::to_string(line) + ")");
    }
}

}  // namespace freetoken_gpu

#define FT_STRINGIFY_EXPANDED_(x) #x
#define FT_STRINGIFY_EXPANDED(x) FT_STRINGIFY_EXPANDED_(x)
#define FT_CHECK(call) ::freetoken_gpu::ft_check((call), FT_STRINGIFY_EXPANDED(call), __FILE__, __LINE__)
/* After a kernel launch: launch-configuration errors surface here. */
#define FT_CHECK_LAUNCH(what) ::freetoken_gpu::ft_check(ftGetLastError(), what, __FILE__, __LINE__)

namespace freetoken_gpu {

/* ---- stream memory operations (write value / wait value on a 64-bit word) ---- */
struct MemopSupport {
    bool available = false;  /* write64 and wait64 usable on this device */
    std::string reason;      /* why not, when not */
};

#ifdef FT_GPU_HIP
inline MemopSupport memop_support(int device) {
    MemopSupport s;
    int wait_ok = 0;
    ftError_t e = hipDeviceGetAttribute(&wait_ok, hipDeviceAttributeCanUseStreamWaitValue, device);
    if (e != hipSuccess) {
        s.reason = std::string("hipDeviceGetAttribute(CanUseStreamWaitValue) failed: ") + hipGetErrorString(e);
    } else if (!wait_ok) {
        s.reason = "device reports hipDeviceAttributeCanUseStreamWaitValue = 0";
    } else {
        s.available = true;
    }
    return s;
}
inline void stream_write_value64(ftStream_t stream, uint64_t dev_addr, uint64_t value) {
    FT_CHECK(hipStreamWriteValue64(stream, reinterpret_cast<void*>(dev_addr), value, 0));
}
inline void stream_wait_value64_eq(ftStream_t stream, uint64_t dev_addr, uint64_t value) {
    FT_CHECK(hipStreamWaitValue64(stream, reinterpret_cast<void*>(dev_addr), value, hipStreamWaitValueEq,
                                  0xFFFFFFFFFFFFFFFFull));
}
#else
/* Driver entry points, resolved once at run time. */
typedef CUresult (*ft_pfn_cuStreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*ft_pfn_cuStreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*ft_pfn_cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
typedef CUresult (*ft_pfn_cuGetErrorName)(CUresult, const char**);
typedef CUresult (*ft_pfn_cuGraphAddBatchMemOpNode)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t,
                                                    const CUDA_BATCH_MEM_OP_NODE_PARAMS*);
typedef CUresult (*ft_pfn_cuCtxGetCurrent)(CUcontext*);
typedef CUresult (*ft_pfn_cuGraphNodeGetType)(CUgraphNode, CUgraphNodeType*);

struct DriverApi {
    ft_pfn_cuStreamWriteValue64 write64 = nullptr;
    ft_pfn_cuStreamWaitValue64 wait64 = nullptr;
    ft_pfn_cuDeviceGetAttribute get_attribute = nullptr;
    ft_pfn_cuGetErrorName error_name = nullptr;
    ft_pfn_cuGraphAddBatchMemOpNode add_memop_node = nullptr;
    ft_pfn_cuCtxGetCurrent ctx_get_current = nullptr;
    ft_pfn_cuGraphNodeGetType node_get_type = nullptr; /* the runtime's has no enum for memop nodes */
    std::string error; /* non-empty when resolution failed */
};

inline void* resolve_driver_symbol(const char* name, std::string& error) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
        if (error.empty()) {
            error = std::string("cudaGetDriverEntryPointByVersion(\"") + name + "\", 12000) failed: " +
                    cudaGetErrorString(e) + " (query result " + std::to_string(static_cast<int>(q)) + ")";
        }
        return nullptr;
    }
    return fn;
}

inline const DriverApi& driver_api() {
    static const DriverApi api = [] {
        DriverApi a;
        a.write64 = reinterpret_cast<ft_pfn_cuStreamWriteValue64>(resolve_driver_symbol("cuStreamWriteValue64", a.error));
        a.wait64 = reinterpret_cast<ft_pfn_cuStreamWaitValue64>(resolve_driver_symbol("cuStreamWaitValue64", a.error));
        a.get_attribute =
            reinterpret_cast<ft_pfn_cuDeviceGetAttribute>(resolve_driver_symbol("cuDeviceGetAttribute", a.error));
        std::string optional_error; /* these two are optional */
        a.error_name = reinterpret_cast<ft_pfn_cuGetErrorName>(resolve_driver_symbol("cuGetErrorName", optional_error));
        a.add_memop_node = reinterpret_cast<ft_pfn_cuGraphAddBatchMemOpNode>(
            resolve_driver_symbol("cuGraphAddBatchMemOpNode", optional_error));
        a.ctx_get_current =
            reinterpret_cast<ft_pfn_cuCtxGetCurrent>(resolve_driver_symbol("cuCtxGetCurrent", optional_error));
        a.node_get_type =
            reinterpret_cast<ft_pfn_cuGraphNodeGetType>(resolve_driver_symbol("cuGraphNodeGetType", optional_error));
        return a;
    }();
    return api;
}

inline void cu_check(CUresult r, const char* call, const char* file, int line) {
    if (r != CUDA_SUCCESS) {
        const char* name = "unknown CUresult";
        if (driver_api().error_name) driver_api().error_name(r, &name);
        throw std::runtime_error(std::string("cuda driver call failed: ") + call + " -> " + name + " (" +
                                 std::to_string(static_cast<int>(r)) + ") (" + file + ":" + std::to_string(line) +
                                 ")");
    }
}
#define FT_CU_CHECK(call) ::freetoken_gpu::cu_check((call), #call, __FILE__, __LINE__)

inline MemopSupport memop_support(int device) {
    MemopSupport s;
    const DriverApi& api = driver_api();
    if (!api.write64 || !api.wait64 || !api.get_attribute) {
        s.reason = api.error.empty() ? "driver entry points for stream memops not found" : api.error;
        return s;
    }
    int v64 = 0;
    CUresult r = api.get_attribute(&v64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device);
    if (r != CUDA_SUCCESS) {
        s.reason = "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS) failed with CUresult " + std::to_string(r);
        return s;
    }
    if (!v64) {
        s.reason = "device reports CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 0";
        return s;
    }
    s.available = true;
    return s;
}

inline void stream_write_value64(ftStream_t stream, uint64_t dev_addr, uint64_t value) {
    const DriverApi& api = driver_api();
    if (!api.write64) throw std::runtime_error("cuStreamWriteValue64 unavailable: " + api.error);
    FT_CU_CHECK(api.write64(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(dev_addr), value,
                            CU_STREAM_WRITE_VALUE_DEFAULT));
}

inline void stream_wait_value64_eq(ftStream_t stream, uint64_t dev_addr, uint64_t value) {
    const DriverApi& api = driver_api();
    if (!api.wait64) throw std::runtime_error("cuStreamWaitValue64 unavailable: " + api.error);
    FT_CU_CHECK(api.wait64(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(dev_addr), value,
                           CU_STREAM_WAIT_VALUE_EQ));
}
#endif

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_PORTABILITY_H */
