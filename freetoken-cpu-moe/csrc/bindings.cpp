// pybind11 module freetoken_cpu_moe._core: raw addresses in, nothing torch-typed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "coordinator.h"
#include "dispatch.h"
#include "host_driver.h"
#include "moe.h"
#include "pool.h"
#include "stream.h"

namespace py = pybind11;
using ft::Pool;

namespace ft {
void register_attention(py::module_& m);    // bindings_attention.cpp
void register_decode_step(py::module_& m);  // bindings_decode_step.cpp
}

namespace {

const ft::KernelTable& kernels_for(const std::string& isa) {
    return isa.empty() ? *ft::active_kernels() : *ft::kernels_by_name(isa);
}

void check_isa(const std::string& isa) {
    if (isa.empty()) return;
    for (const auto& t : ft::isa_tiers())
        if (t == isa) return;
    throw std::invalid_argument("ISA tier '" + isa + "' is not supported by this CPU");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "freetoken_cpu_moe native core (see the Python package for the documented API)";
    m.attr("ABI_VERSION") = FT_HANDOFF_ABI_VERSION;
    py::register_exception<ft::BadTask>(m, "BadTask", PyExc_ValueError);

    m.def("isa_tiers", &ft::isa_tiers);
    m.def("tier_order", &ft::tier_order);
    m.def("active_isa", [] { return std::string(ft::active_kernels()->name); });
    m.def("set_isa", &ft::set_active_isa);
    m.def("mxfp4_vbmi", &ft::mxfp4_vbmi, "whether the AVX-512 MXFP4 kernels use the AVX512-VBMI permutes");
    m.def("set_mxfp4_vbmi", &ft::set_mxfp4_vbmi, py::arg("on"),
          "turn the AVX512-VBMI MXFP4 path on or off (tests, A/B timings); returns the previous setting");

    py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
        .def(py::init<int, std::vector<int>, double>(), py::arg("num_threads"), py::arg("cpus"), py::arg("spin_us"))
        .def_property_readonly("num_threads", &Pool::num_threads)
        .def_property_readonly("closed", &Pool::closed)
        .def_property("spin_us", &Pool::spin_us, &Pool::set_spin_us)
        .def("_inject_worker_delay", &Pool::inject_worker_delay, py::arg("tid"), py::arg("ms"))
        .def("close", &Pool::close, py::call_guard<py::gil_scoped_release>());

    m.def(
        "moe_forward",
        [](uint64_t bank, uint64_t x, uint32_t x_fmt, uint64_t ids, uint64_t w, uint64_t y, uint32_t y_fmt, uint32_t T,
           uint32_t K, bool accumulate, std::shared_ptr<Pool> pool, const std::string& isa) {
            check_isa(isa);
            ft::MoeCall c;
            c.bank = (const ft_expert_bank*)(uintptr_t)bank;
            c.x = (const void*)(uintptr_t)x;
            c.x_fmt = x_fmt;
            c.ids = (const int32_t*)(uintptr_t)ids;
            c.w = (const float*)(uintptr_t)w;
            c.y = (void*)(uintptr_t)y;
            c.y_fmt = y_fmt;
            c.T = T;
            c.K = K;
            c.accumulate = accumulate;
            const ft::KernelTable& k = kernels_for(isa);
            py::gil_scoped_release nogil;
            ft::moe_forward(c, *pool, k);
        },
        py::arg("bank"), py::arg("x"), py::arg("x_fmt"), py::arg("ids"), py::arg("w"), py::arg("y"), py::arg("y_fmt"),
        py::arg("T"), py::arg("K"), py::arg("accumulate"), py::arg("pool"), py::arg("isa") = "");

    m.def(
        "linear",
        [](uint64_t wdesc, uint64_t x, uint32_t x_fmt, uint32_t T, uint64_t y, uint32_t y_fmt, bool accumulate,
           std::shared_ptr<Pool> pool, const std::string& isa) {
            check_isa(isa);
            if (!wdesc) throw std::invalid_argument("linear: null weight descriptor");
            const ft::KernelTable& k = kernels_for(isa);
            py::gil_scoped_release nogil;
            ft::linear_forward(*(const ft_weight_desc*)(uintptr_t)wdesc, (const void*)(uintptr_t)x, x_fmt, T,
                               (void*)(uintptr_t)y, y_fmt, accumulate, *pool, k);
        },
        py::arg("wdesc"), py::arg("x"), py::arg("x_fmt"), py::arg("T"), py::arg("y"), py::arg("y_fmt"),
        py::arg("accumulate"), py::arg("pool"), py::arg("isa") = "");

    // linear without accumulate, returning argmax[t] = the first position of the largest value of
    // y's row t (moe.h) as a list (no buffer for the caller to read back); y = 0: the values
    // are not stored
    m.def(
        "linear_argmax",
        [](uint64_t wdesc, uint64_t x, uint32_t x_fmt, uint32_t T, uint64_t y, uint32_t y_fmt,
           std::shared_ptr<Pool> pool, const std::string& isa) {
            check_isa(isa);
            if (!wdesc) throw std::invalid_argument("linear_argmax: null weight descriptor");
            const ft::KernelTable& k = kernels_for(isa);
            std::vector<int64_t> ids(T);
            {
                py::gil_scoped_release nogil;
                ft::linear_forward(*(const ft_weight_desc*)(uintptr_t)wdesc, (const void*)(uintptr_t)x, x_fmt, T,
                                   (void*)(uintptr_t)y, y_fmt, false, *pool, k, ids.data());
            }
            py::list out(T);
            for (uint32_t t = 0; t < T; ++t) out[t] = py::int_(ids[t]);
            return out;
        },
        py::arg("wdesc"), py::arg("x"), py::arg("x_fmt"), py::arg("T"), py::arg("y"), py::arg("y_fmt"),
        py::arg("pool"), py::arg("isa") = "");

    m.def(
        "run_task",
        [](uint64_t desc, std::shared_ptr<Pool> pool, const std::string& isa) {
            check_isa(isa);
            const ft::KernelTable& k = kernels_for(isa);
            py::gil_scoped_release nogil;
            ft::run_task((const ft_task_desc*)(uintptr_t)desc, *pool, k);
        },
        py::arg("desc"), py::arg("pool"), py::arg("isa") = "");

    ft::register_attention(m);
    ft::register_decode_step(m);

    m.def(
        "validate_bank", [](uint64_t bank) { ft::validate_bank(*(const ft_expert_bank*)(uintptr_t)bank); },
        py::arg("bank"));

    // Stream a buffer with the pool (the bench's memory-bandwidth ceiling): each
    // worker sums its contiguous share with 64-byte loads; returns a checksum.
    m.def(
        "stream_read",
        [](uint64_t addr, uint64_t nbytes, std::shared_ptr<Pool> pool) {
            py::gil_scoped_release nogil;
            return ft::stream_read((const uint8_t*)(uintptr_t)addr, nbytes, *pool, *ft::active_kernels());
        },
        py::arg("addr"), py::arg("nbytes"), py::arg("pool"));

    m.def("drive_handoffs", &ft::drive_handoffs, py::arg("descs"), py::arg("rounds"), py::arg("timeout_ms"),
          py::call_guard<py::gil_scoped_release>());
    m.def(
        "time_run_task",
        [](const std::vector<uint64_t>& descs, int rounds, std::shared_ptr<Pool> pool) {
            py::gil_scoped_release nogil;
            return ft::time_run_task(descs, rounds, *pool);
        },
        py::arg("descs"), py::arg("rounds"), py::arg("pool"));

    m.def(
        "time_dot_rows",
        [](uint64_t wdesc, uint64_t x, uint32_t T, int rounds, const std::string& isa) {
            check_isa(isa);
            if (!wdesc) throw std::invalid_argument("time_dot_rows: null weight descriptor");
            const ft::KernelTable& k = kernels_for(isa);
            py::gil_scoped_release nogil;
            return ft::time_dot_rows(*(const ft_weight_desc*)(uintptr_t)wdesc, (const float*)(uintptr_t)x, T, rounds, k);
        },
        py::arg("wdesc"), py::arg("x"), py::arg("T"), py::arg("rounds"), py::arg("isa") = "");

    py::class_<ft::Coordinator>(m, "Coordinator")
        .def(py::init<std::shared_ptr<Pool>, double, double>(), py::arg("pool"), py::arg("watchdog_ms"),
             py::arg("spin_us"))
        .def("add_task", &ft::Coordinator::add_task)
        .def("remove_task", &ft::Coordinator::remove_task, py::call_guard<py::gil_scoped_release>())
        .def("start", &ft::Coordinator::start)
        .def("stop", &ft::Coordinator::stop, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("running", &ft::Coordinator::running)
        .def_property_readonly("num_tasks", &ft::Coordinator::num_tasks)
        .def("stats",
             [](const ft::Coordinator& c) {
                 auto s = c.stats();
                 py::dict d;
                 d["served"] = s.served;
                 d["errors"] = s.errors;
                 d["watchdog_fired"] = s.watchdog_fired;
                 d["sleeps"] = s.sleeps;
                 d["busy_ns"] = s.busy_ns;
                 return d;
             })
        .def("trace_start", &ft::Coordinator::trace_start, py::call_guard<py::gil_scoped_release>())
        .def("trace",
             [](const ft::Coordinator& c) {
                 py::list out;
                 for (const auto& r : c.trace()) out.append(py::make_tuple(r.desc, r.claim_ns, r.run_ns, r.done_ns, r.gpu_publish_start_ns,
                                                           r.gpu_ready_ns, r.gpu_prev_done_seen_ns, r.gpu_prev_y_read_ns));
                 return out;
             })
        .def("_inject_stall_ms", &ft::Coordinator::inject_stall_ms)
        .def("_inject_fault", &ft::Coordinator::inject_fault);
}
