/*
 * The pybind11 surface of a FreeToken GPU backend extension, shared by freetoken-cuda
 * (module freetoken_cuda._C) and freetoken-rocm (freetoken_rocm._C). Each package's
 * csrc file is just:
 *     #include <freetoken/gpu/module_bindings.cuh>
 *     PYBIND11_MODULE(_C, m) { freetoken_gpu::bind_module(m); }
 * Everything is integers (addresses, stream handles, sizes): no libtorch, no torch types.
 */
#ifndef FREETOKEN_GPU_MODULE_BINDINGS_CUH
#define FREETOKEN_GPU_MODULE_BINDINGS_CUH

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <freetoken/gpu/runtime_host.cuh>
#ifndef FT_GPU_HIP
#include <freetoken/gpu/packed_gemv.cuh>
#include <freetoken/gpu/packed_moe.cuh>
#endif

namespace freetoken_gpu {

namespace py = pybind11;

inline py::dict device_info_dict(int device) {
    DeviceInfo d = device_info(device);
    py::dict r;
    r["name"] = d.name;
    r["arch"] = d.arch;
#ifndef FT_GPU_HIP
    r["capability"] = py::make_tuple(d.major, d.minor); /* an AMD gfx target is no compute capability */
#endif
    r["total_memory"] = d.total_memory;
    r["multiprocessors"] = d.multiprocessors;
    r["can_map_host_memory"] = static_cast<bool>(d.can_map_host_memory);
    r["unified_addressing"] = static_cast<bool>(d.unified_addressing);
    r["pageable_memory_access"] = static_cast<bool>(d.pageable_memory_access);
    r["stream_memops"] = d.memops;
    r["stream_memops_reason"] = d.memops_reason;
    if (d.memops_v1_attr >= 0) r["stream_memops_v1_attribute"] = d.memops_v1_attr;
    return r;
}

inline py::dict graph_memop_probe_dict(uint64_t host_addr, uint64_t dev_addr) {
    GraphMemopProbe p;
    {
        py::gil_scoped_release release;
        p = probe_graph_memops(host_addr, dev_addr);
    }
    py::dict r;
    r["capture_ok"] = p.capture_ok;
    r["flag_unchanged_during_capture"] = p.flag_unchanged_during_capture;
    r["nodes"] = p.nodes;
    r["memop_nodes"] = p.memop_nodes;
    r["replay_performed"] = p.replay_performed;
    r["native"] = p.native;
    r["explicit_ok"] = p.explicit_ok;
    r["error"] = p.error;
    r["explicit_error"] = p.explicit_error;
    return r;
}

inline py::dict event_support_dict() {
    EventSupport e;
    {
        py::gil_scoped_release release;
        e = event_support();
    }
    py::dict r;
    r["compiled"] = e.compiled;
    r["available"] = e.available;
    r["reason"] = e.reason;
    return r;
}

inline void bind_module(py::module_& m) {
    m.doc() = "FreeToken GPU backend native surface (" FT_GPU_API_NAME "): queries, probes, hand-off kernels";
    m.attr("API") = FT_GPU_API_NAME;
    m.attr("HANDOFF_ABI_VERSION") = static_cast<int>(FT_HANDOFF_ABI_VERSION);
    m.attr("DONE_SKIPPED") = static_cast<uint64_t>(FT_DONE_SKIPPED);
    m.attr("FAULT_NONE") = FT_FAULT_NONE;
    m.attr("FAULT_STALE") = FT_FAULT_STALE;
    m.attr("FAULT_NOFENCE") = FT_FAULT_NOFENCE;
    m.attr("RUNTIME_VERSION_COMPILED") = static_cast<int>(FT_RUNTIME_VERSION_COMPILED);
#ifdef FT_GPU_HIP
    m.attr("EVENT_RECORD_WITH_FLAGS") = static_cast<bool>(FT_HIP_EVENT_RECORD_WITH_FLAGS);
#else
    m.attr("EVENT_RECORD_WITH_FLAGS") = false;
#endif
    m.def("device_count", &device_count, "number of visible devices (raises with the runtime's error)");
    m.def("device_info", &device_info_dict, py::arg("device"));
    m.def("runtime_version", &runtime_version);
    m.def("driver_version", &driver_version);
    m.def(
        "host_alloc",
        [](size_t nbytes, bool mapped) {
            HostAllocation a = host_alloc(nbytes, mapped);
            return py::make_tuple(a.host, a.device);
        },
        py::arg("nbytes"), py::arg("mapped"), "page-locked host memory -> (host_ptr, device_ptr or 0)");
    m.def("host_free", &host_free, py::arg("host_ptr"));
    m.def("host_register", &host_register, py::arg("ptr"), py::arg("nbytes"), py::arg("mapped"),
          py::arg("read_only") = false,
          "page-lock and register existing host memory (read_only: a read-only mapping such as a "
          "model file) -> device_ptr (0 unless mapped)");
    m.def("host_unregister", &host_unregister, py::arg("ptr"));
    m.def("stream_is_capturing", &stream_is_capturing, py::arg("stream"));
    m.def("memop_write", &memop_write, py::arg("stream"), py::arg("dev_addr"), py::arg("value"),
          py::arg("explicit_node") = false);
    m.def("memop_wait", &memop_wait, py::arg("stream"), py::arg("dev_addr"), py::arg("value"),
          py::arg("explicit_node") = false, py::arg("err_addr") = 0);
    m.def("event_support", &event_support_dict,
          "can this build and runtime record a system-release event as a captured graph node?");
    m.def("release_event_create", &release_event_create, "an event with a system-scope release (HIP)");
    m.def("release_event_destroy", &release_event_destroy, py::arg("event"));
    m.def("release_event_record", &release_event_record, py::arg("stream"), py::arg("event"),
          "record the release event (under capture: as an external event-record node)");
    m.def("host_callback_probe", &host_callback_probe,
          "run a host function on a private stream: '' when it ran, else the error");
    m.def("flag_write_kernel", &launch_flag_write, py::arg("stream"), py::arg("dev_addr"), py::arg("value"));
    m.def("flag_wait_kernel", &launch_flag_wait, py::arg("stream"), py::arg("dev_addr"), py::arg("value"),
          py::arg("reset"), py::arg("err_addr"), py::arg("timeout_ns"));
    m.def("kio_publish", &kio_publish, py::arg("stream"), py::arg("x"), py::arg("ids"), py::arg("ids_are_64"),
          py::arg("w"), py::arg("n_x"), py::arg("tokens"), py::arg("top_k"), py::arg("cpu_mask"), py::arg("resident"),
          py::arg("cpu_last_n"), py::arg("dst_x"), py::arg("dst_ids"), py::arg("dst_w"), py::arg("flags"),
          py::arg("fault") = 0,
          "KernelIO publish: x, CPU routes (split in the kernel: mask > last_n > resident > id>=0) and weights into "
          "mapped memory, system fence, ready = 1 (or done = DONE_SKIPPED when no route goes to the CPU)");
    m.def("kio_combine", &kio_combine, py::arg("stream"), py::arg("out"), py::arg("y"), py::arg("y_is_f32"),
          py::arg("n"), py::arg("flags"), py::arg("timeout_ns"));
    m.def("host_callback_publish", &host_callback_publish, py::arg("stream"), py::arg("slot_host"));
    m.def("host_callback_wait", &host_callback_wait, py::arg("stream"), py::arg("slot_host"), py::arg("timeout_ns"));
#ifndef FT_GPU_HIP
    m.attr("GEMV_MAX_COLS") = GEMV_MAX_COLS;
    m.def("packed_gemv", &packed_gemv, py::arg("stream"), py::arg("x"), py::arg("x_dtype"), py::arg("w"), py::arg("fmt"),
          py::arg("rows"), py::arg("cols"), py::arg("row_bytes"), py::arg("y"), py::arg("y_dtype"),
          "one token through Q4_K/Q6_K/Q8_0 blocks: y[rows] = W x (dtype codes 0 f32, 1 f16, 2 bf16; int8 dots)");
    m.def("packed_gemv_norm", &packed_gemv_norm, py::arg("stream"), py::arg("h"), py::arg("delta"), py::arg("weight"),
          py::arg("eps"), py::arg("h_out"), py::arg("x_out"), py::arg("dtype"), py::arg("cols"), py::arg("w_a"),
          py::arg("fmt_a"), py::arg("rows_a"), py::arg("row_bytes_a"), py::arg("y_a"), py::arg("w_b"), py::arg("fmt_b"),
          py::arg("rows_b"), py::arg("row_bytes_b"), py::arg("y_b"),
          "x = weight * rmsnorm(h + delta), then y_a = A x and y_b = B x (Q4_K/Q6_K/Q8_0), one launch");
    m.def("packed_gemv_refusal", &packed_gemv_refusal, py::arg("fmt"), py::arg("cols"),
          "'' when packed_gemv serves this format and width, else why not");
    m.def("packed_moe", &packed_moe, py::arg("stream"), py::arg("x"), py::arg("x_dtype"), py::arg("tokens"),
          py::arg("ids"), py::arg("ids_64"), py::arg("table"), py::arg("w"), py::arg("w_dtype"), py::arg("top_k"),
          py::arg("gate"), py::arg("gate_fmt"), py::arg("up"), py::arg("up_fmt"), py::arg("down"), py::arg("down_fmt"),
          py::arg("hidden"), py::arg("inter"), py::arg("act"), py::arg("alpha"), py::arg("limit"), py::arg("scratch"),
          py::arg("y"), py::arg("y_dtype"),
          "a few tokens through their routed Q4_K/Q6_K/Q8_0/MXFP4 experts (SiLU or clamped SwiGLU), two launches, "
          "int8 dots");
    m.def("packed_moe_refusal", &packed_moe_refusal, py::arg("gate_fmt"), py::arg("up_fmt"), py::arg("down_fmt"),
          py::arg("hidden"), py::arg("inter"), py::arg("top_k"), py::arg("act"),
          "'' when packed_moe serves these expert formats and shapes, else why not");
    m.def("packed_moe_scratch_bytes", &packed_moe_scratch_bytes, py::arg("routes"), py::arg("inter"),
          "bytes of packed_moe's scratch for this many routes of `inter` values");
#endif
    m.def("graph_memop_probe", &graph_memop_probe_dict, py::arg("host_addr"), py::arg("dev_addr"),
          "capture memops on a private stream: recorded natively? as explicit nodes?");
}

}  // namespace freetoken_gpu

#endif /* FREETOKEN_GPU_MODULE_BINDINGS_CUH */
