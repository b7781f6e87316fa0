// pybind11 registration of the one-call decode step (raw addresses in;
// freetoken_cpu_moe.decode_step checks the model and the tensors).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <tuple>

#include "decode_step.h"
#include "dispatch.h"
#include "pool.h"

namespace py = pybind11;

namespace ft {

namespace {

template <class T>
T* ptr(uint64_t a) {
    return (T*)(uintptr_t)a;
}

// (in_norm, post_norm, [qkv descs], [qkv cols], q_norm, k_norm, o, router, bank, k_cache, v_cache)
using LayerArgs = std::tuple<uint64_t, uint64_t, std::vector<uint64_t>, std::vector<uint64_t>, uint64_t, uint64_t,
                             uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>;

}  // namespace

void register_decode_step(py::module_& m) {
    py::class_<DecodeStep>(m, "DecodeStep")
        .def(py::init([](uint32_t fmt, uint32_t norm_fmt, uint32_t kv_fmt, uint32_t H, uint32_t Hq, uint32_t Hkv,
                         uint32_t D, uint32_t E, uint32_t K, bool norm_topk, float eps, float scale, uint64_t final_norm,
                         uint64_t cos, uint64_t sin_signed, uint32_t max_pos, uint32_t num_blocks, uint32_t block_size,
                         const std::vector<LayerArgs>& layers) {
                 DecodeModel dm;
                 dm.fmt = fmt;
                 dm.norm_fmt = norm_fmt;
                 dm.kv_fmt = kv_fmt;
                 dm.H = H;
                 dm.Hq = Hq;
                 dm.Hkv = Hkv;
                 dm.D = D;
                 dm.E = E;
                 dm.K = K;
                 dm.norm_topk = norm_topk;
                 dm.eps = eps;
                 dm.scale = scale;
                 dm.final_norm = ptr<const void>(final_norm);
                 dm.cos = ptr<const float>(cos);
                 dm.sin_signed = ptr<const float>(sin_signed);
                 dm.max_pos = max_pos;
                 dm.num_blocks = num_blocks;
                 dm.block_size = block_size;
                 for (const LayerArgs& a : layers) {
                     DecodeLayer L;
                     L.in_norm = ptr<const void>(std::get<0>(a));
                     L.post_norm = ptr<const void>(std::get<1>(a));
                     for (uint64_t d : std::get<2>(a)) L.qkv.push_back(ptr<const ft_weight_desc>(d));
                     L.qkv_col = std::get<3>(a);
                     L.q_norm = ptr<const void>(std::get<4>(a));
                     L.k_norm = ptr<const void>(std::get<5>(a));
                     L.o = ptr<const ft_weight_desc>(std::get<6>(a));
                     L.router = ptr<const ft_weight_desc>(std::get<7>(a));
                     L.bank = ptr<const ft_expert_bank>(std::get<8>(a));
                     L.k_cache = ptr<void>(std::get<9>(a));
                     L.v_cache = ptr<void>(std::get<10>(a));
                     dm.layers.push_back(std::move(L));
                 }
                 return std::make_unique<DecodeStep>(std::move(dm));
             }),
             py::arg("fmt"), py::arg("norm_fmt"), py::arg("kv_fmt"), py::arg("H"), py::arg("Hq"), py::arg("Hkv"),
             py::arg("D"), py::arg("E"), py::arg("K"), py::arg("norm_topk"), py::arg("eps"), py::arg("scale"),
             py::arg("final_norm"), py::arg("cos"), py::arg("sin_signed"), py::arg("max_pos"), py::arg("num_blocks"),
             py::arg("block_size"), py::arg("layers"))
        .def(
            "run",
            [](DecodeStep& s, uint32_t T, uint64_t embed, uint64_t positions, uint64_t slots, uint32_t num_seqs,
               uint64_t q_start, uint64_t q_len, uint64_t ctx_len, uint64_t block_table, uint32_t bt_stride,
               uint64_t out, std::shared_ptr<Pool> pool) {
                if (!pool) throw std::invalid_argument("decode step: no pool");
                DecodeStepIO io;
                io.T = T;
                io.embed = ptr<const void>(embed);
                io.positions = ptr<const int64_t>(positions);
                io.slots = ptr<const int64_t>(slots);
                io.num_seqs = num_seqs;
                io.q_start = ptr<const int32_t>(q_start);
                io.q_len = ptr<const int32_t>(q_len);
                io.ctx_len = ptr<const int32_t>(ctx_len);
                io.block_table = ptr<const int32_t>(block_table);
                io.bt_stride = bt_stride;
                io.out = ptr<void>(out);
                const KernelTable& k = *active_kernels();
                py::gil_scoped_release nogil;
                s.run(io, *pool, k);
            },
            py::arg("T"), py::arg("embed"), py::arg("positions"), py::arg("slots"), py::arg("num_seqs"),
            py::arg("q_start"), py::arg("q_len"), py::arg("ctx_len"), py::arg("block_table"), py::arg("bt_stride"),
            py::arg("out"), py::arg("pool"))
        .def_readwrite("profile", &DecodeStep::profile)
        .def_readonly("steps", &DecodeStep::steps)
        .def("part_ns",
             [](const DecodeStep& s) { return std::vector<uint64_t>(s.part_ns, s.part_ns + kNumParts); })
        .def("reset_profile", [](DecodeStep& s) {
            for (uint64_t& t : s.part_ns) t = 0;
            s.steps = 0;
        });
}

}  // namespace ft
