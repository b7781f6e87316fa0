// pybind11 registrations of the attention kernel, the fused decode ops (the DeltaNet
// decode step among them) and grouped projections (raw addresses in;
// freetoken_cpu_moe.attention, .decode_ops and .dense check the arrays).
#include <pybind11/pybind11.h>

#include <memory>

#include "attention.h"
#include "decode_ops.h"
#include "deltanet.h"
#include "dispatch.h"
#include "linear_group.h"
#include "linear_heads.h"
#include "pool.h"

namespace py = pybind11;

namespace ft {

void register_attention(py::module_& m) {
    m.def(
        "paged_attention",
        [](uint64_t q, uint32_t q_fmt, uint64_t q_tok, uint64_t q_head, uint64_t k_cache, uint64_t v_cache,
           uint32_t kv_fmt, uint32_t num_blocks, uint32_t block_size, uint32_t num_kv_heads, uint32_t head_dim,
           uint32_t num_heads, uint32_t num_seqs, uint64_t q_start, uint64_t q_len, uint64_t ctx_len,
           uint64_t block_table, uint32_t bt_stride, uint32_t num_tokens, uint64_t out, uint32_t out_fmt, float scale,
           uint32_t window, uint64_t sinks, std::shared_ptr<Pool> pool, const std::string& isa) {
            AttnCall c;
            c.q = (const void*)(uintptr_t)q;
            c.q_fmt = q_fmt;
            c.q_tok = q_tok;
            c.q_head = q_head;
            c.k_cache = (const void*)(uintptr_t)k_cache;
            c.v_cache = (const void*)(uintptr_t)v_cache;
            c.kv_fmt = kv_fmt;
            c.num_blocks = num_blocks;
            c.block_size = block_size;
            c.num_kv_heads = num_kv_heads;
            c.head_dim = head_dim;
            c.num_heads = num_heads;
            c.num_seqs = num_seqs;
            c.q_start = (const int32_t*)(uintptr_t)q_start;
            c.q_len = (const int32_t*)(uintptr_t)q_len;
            c.ctx_len = (const int32_t*)(uintptr_t)ctx_len;
            c.block_table = (const int32_t*)(uintptr_t)block_table;
            c.bt_stride = bt_stride;
            c.num_tokens = num_tokens;
            c.out = (void*)(uintptr_t)out;
            c.out_fmt = out_fmt;
            c.scale = scale;
            c.window = window;
            c.sinks = (const float*)(uintptr_t)sinks;
            const KernelTable& k = isa.empty() ? *active_kernels() : *kernels_by_name(isa);
            if (!pool) throw std::invalid_argument("paged_attention: no pool");
            py::gil_scoped_release nogil;
            paged_attention(c, *pool, k);
        },
        py::arg("q"), py::arg("q_fmt"), py::arg("q_tok"), py::arg("q_head"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("kv_fmt"), py::arg("num_blocks"), py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("num_heads"), py::arg("num_seqs"), py::arg("q_start"), py::arg("q_len"), py::arg("ctx_len"),
        py::arg("block_table"), py::arg("bt_stride"), py::arg("num_tokens"), py::arg("out"), py::arg("out_fmt"),
        py::arg("scale"), py::arg("window"), py::arg("sinks"), py::arg("pool"), py::arg("isa") = "");

    m.def(
        "add_rms_norm",
        [](uint64_t h, uint64_t delta, uint64_t w, uint32_t w_fmt, uint64_t h_out, uint64_t x_out, uint32_t fmt,
           uint32_t T, uint32_t n, float eps) {
            add_rms_norm((const void*)(uintptr_t)h, (const void*)(uintptr_t)delta, (const void*)(uintptr_t)w, w_fmt,
                         (void*)(uintptr_t)h_out, (void*)(uintptr_t)x_out, fmt, T, n, eps);
        },
        py::arg("h"), py::arg("delta"), py::arg("w"), py::arg("w_fmt"), py::arg("h_out"), py::arg("x_out"),
        py::arg("fmt"), py::arg("T"), py::arg("n"), py::arg("eps"));

    m.def(
        "qk_norm_rope_store",
        [](uint64_t q, uint64_t k, uint64_t v, uint64_t q_tok, uint64_t k_tok, uint64_t v_tok, uint32_t fmt, uint32_t T,
           uint32_t Hq, uint32_t Hkv, uint32_t D, uint64_t q_w, uint64_t k_w, uint32_t w_fmt, float eps, uint64_t cos,
           uint64_t sin_signed, uint32_t max_pos, uint64_t positions, uint64_t slots, uint64_t k_cache,
           uint64_t v_cache, uint32_t kv_fmt, uint64_t num_slots, uint64_t q_out, uint64_t q_b, uint64_t k_b,
           uint64_t v_b) {
            QkRopeCall c;
            c.q = (const void*)(uintptr_t)q;
            c.k = (const void*)(uintptr_t)k;
            c.v = (const void*)(uintptr_t)v;
            c.q_tok = q_tok;
            c.k_tok = k_tok;
            c.v_tok = v_tok;
            c.fmt = fmt;
            c.T = T;
            c.Hq = Hq;
            c.Hkv = Hkv;
            c.D = D;
            c.q_w = (const void*)(uintptr_t)q_w;
            c.k_w = (const void*)(uintptr_t)k_w;
            c.w_fmt = w_fmt;
            c.eps = eps;
            c.cos = (const float*)(uintptr_t)cos;
            c.sin_signed = (const float*)(uintptr_t)sin_signed;
            c.max_pos = max_pos;
            c.positions = (const int64_t*)(uintptr_t)positions;
            c.slots = (const int64_t*)(uintptr_t)slots;
            c.k_cache = (void*)(uintptr_t)k_cache;
            c.v_cache = (void*)(uintptr_t)v_cache;
            c.kv_fmt = kv_fmt;
            c.num_slots = num_slots;
            c.q_out = (void*)(uintptr_t)q_out;
            c.q_b = (const float*)(uintptr_t)q_b;
            c.k_b = (const float*)(uintptr_t)k_b;
            c.v_b = (const float*)(uintptr_t)v_b;
            qk_norm_rope_store(c);
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_tok"), py::arg("k_tok"), py::arg("v_tok"), py::arg("fmt"),
        py::arg("T"), py::arg("Hq"), py::arg("Hkv"), py::arg("D"), py::arg("q_w"), py::arg("k_w"), py::arg("w_fmt"),
        py::arg("eps"), py::arg("cos"), py::arg("sin_signed"), py::arg("max_pos"), py::arg("positions"),
        py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"), py::arg("kv_fmt"), py::arg("num_slots"),
        py::arg("q_out"), py::arg("q_b") = 0, py::arg("k_b") = 0, py::arg("v_b") = 0);

    m.def(
        "moe_bias_add",
        [](uint64_t y, uint64_t y_tok, uint32_t fmt, uint32_t T, uint32_t H, uint64_t ids, uint64_t w, uint32_t K,
           uint64_t bias, uint32_t E, uint64_t out) {
            moe_bias_add((const void*)(uintptr_t)y, y_tok, fmt, T, H, (const int32_t*)(uintptr_t)ids,
                         (const float*)(uintptr_t)w, K, (const float*)(uintptr_t)bias, E, (void*)(uintptr_t)out);
        },
        py::arg("y"), py::arg("y_tok"), py::arg("fmt"), py::arg("T"), py::arg("H"), py::arg("ids"), py::arg("w"),
        py::arg("K"), py::arg("bias"), py::arg("E"), py::arg("out"));

    m.def(
        "linear_group",
        [](uint64_t descs, uint32_t n, uint64_t x, uint32_t x_fmt, uint32_t T, uint64_t y, uint32_t y_fmt,
           uint64_t y_stride, uint64_t cols, std::shared_ptr<Pool> pool, const std::string& isa) {
            if (!pool) throw std::invalid_argument("linear_group: no pool");
            const KernelTable& k = isa.empty() ? *active_kernels() : *kernels_by_name(isa);
            py::gil_scoped_release nogil;
            linear_group((const ft_weight_desc* const*)(uintptr_t)descs, n, (const void*)(uintptr_t)x, x_fmt, T,
                         (void*)(uintptr_t)y, y_fmt, y_stride, (const uint64_t*)(uintptr_t)cols, *pool, k);
        },
        py::arg("descs"), py::arg("n"), py::arg("x"), py::arg("x_fmt"), py::arg("T"), py::arg("y"), py::arg("y_fmt"),
        py::arg("y_stride"), py::arg("cols"), py::arg("pool"), py::arg("isa") = "");

    m.def(
        "linear_heads",
        [](uint64_t wdesc, uint64_t x, uint32_t x_fmt, uint32_t T, uint64_t y, uint32_t y_fmt,
           std::shared_ptr<Pool> pool, const std::string& isa) {
            if (!pool) throw std::invalid_argument("linear_heads: no pool");
            if (!wdesc) throw std::invalid_argument("linear_heads: null weight descriptor");
            const KernelTable& k = isa.empty() ? *active_kernels() : *kernels_by_name(isa);
            py::gil_scoped_release nogil;
            linear_heads(*(const ft_weight_desc*)(uintptr_t)wdesc, (const void*)(uintptr_t)x, x_fmt, T,
                         (void*)(uintptr_t)y, y_fmt, *pool, k);
        },
        py::arg("wdesc"), py::arg("x"), py::arg("x_fmt"), py::arg("T"), py::arg("y"), py::arg("y_fmt"),
        py::arg("pool"), py::arg("isa") = "");

    m.def(
        "deltanet_decode",
        [](uint64_t mixed, uint64_t z, uint64_t b, uint64_t a, uint64_t mixed_tok, uint64_t z_tok, uint64_t b_tok,
           uint64_t a_tok, uint32_t fmt, uint32_t T, uint32_t key_heads, uint32_t value_heads, uint32_t key_dim,
           uint32_t value_dim, uint32_t conv_kernel, bool tiled, uint64_t conv_w, uint32_t conv_w_fmt, uint64_t A,
           uint64_t dt_bias, uint64_t norm_w, uint32_t norm_fmt, float eps, uint64_t slots, uint64_t num_slots,
           uint64_t conv_state, uint32_t conv_fmt, uint64_t ssm_state, uint64_t out, std::shared_ptr<Pool> pool) {
            if (!pool) throw std::invalid_argument("deltanet_decode: no pool");
            DeltaNetDecodeCall c;
            c.mixed = (const void*)(uintptr_t)mixed;
            c.z = (const void*)(uintptr_t)z;
            c.b = (const void*)(uintptr_t)b;
            c.a = (const void*)(uintptr_t)a;
            c.mixed_tok = mixed_tok;
            c.z_tok = z_tok;
            c.b_tok = b_tok;
            c.a_tok = a_tok;
            c.fmt = fmt;
            c.T = T;
            c.key_heads = key_heads;
            c.value_heads = value_heads;
            c.key_dim = key_dim;
            c.value_dim = value_dim;
            c.conv_kernel = conv_kernel;
            c.tiled = tiled;
            c.conv_w = (const void*)(uintptr_t)conv_w;
            c.conv_w_fmt = conv_w_fmt;
            c.A = (const float*)(uintptr_t)A;
            c.dt_bias = (const float*)(uintptr_t)dt_bias;
            c.norm_w = (const void*)(uintptr_t)norm_w;
            c.norm_fmt = norm_fmt;
            c.eps = eps;
            c.slots = (const int64_t*)(uintptr_t)slots;
            c.num_slots = num_slots;
            c.conv_state = (void*)(uintptr_t)conv_state;
            c.conv_fmt = conv_fmt;
            c.ssm_state = (float*)(uintptr_t)ssm_state;
            c.out = (void*)(uintptr_t)out;
            py::gil_scoped_release nogil;
            deltanet_decode(c, *pool);
        },
        py::arg("mixed"), py::arg("z"), py::arg("b"), py::arg("a"), py::arg("mixed_tok"), py::arg("z_tok"),
        py::arg("b_tok"), py::arg("a_tok"), py::arg("fmt"), py::arg("T"), py::arg("key_heads"),
        py::arg("value_heads"), py::arg("key_dim"), py::arg("value_dim"), py::arg("conv_kernel"), py::arg("tiled"),
        py::arg("conv_w"), py::arg("conv_w_fmt"), py::arg("A"), py::arg("dt_bias"), py::arg("norm_w"),
        py::arg("norm_fmt"), py::arg("eps"), py::arg("slots"), py::arg("num_slots"), py::arg("conv_state"),
        py::arg("conv_fmt"), py::arg("ssm_state"), py::arg("out"), py::arg("pool"));

    m.def(
        "router_top_k",
        [](uint64_t logits, uint32_t T, uint32_t E, uint32_t k, bool norm, uint64_t ids, uint64_t w) {
            router_top_k((const float*)(uintptr_t)logits, T, E, k, norm, (int32_t*)(uintptr_t)ids,
                         (float*)(uintptr_t)w);
        },
        py::arg("logits"), py::arg("T"), py::arg("E"), py::arg("k"), py::arg("norm"), py::arg("ids"), py::arg("w"));
}

}  // namespace ft
