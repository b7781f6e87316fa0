#include "decode_step.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <utility>

#include "act_rows.h"
#include "attention.h"
#include "decode_ops.h"
#include "linear_group.h"
#include "moe.h"

namespace ft {
namespace {

using act_rows::esize;
using act_rows::is_act;

size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void check_weight(const ft_weight_desc* w, uint32_t rows, uint32_t cols, size_t layer, const char* what) {
    const std::string where = "decode step: layer " + std::to_string(layer) + " " + what;
    if (!w) throw std::invalid_argument(where + ": no weights");
    if (w->num_experts != 1 || w->rows != rows || w->cols != cols)
        throw std::invalid_argument(where + ": " + std::to_string(w->num_experts) + " x [" + std::to_string(w->rows) +
                                    ", " + std::to_string(w->cols) + "], expected one [" + std::to_string(rows) +
                                    ", " + std::to_string(cols) + "] matrix");
}

}  // namespace

DecodeStep::DecodeStep(DecodeModel m) : m_(std::move(m)) {
    auto bad = [](const std::string& why) { throw std::invalid_argument("decode step: " + why); };
    if (!is_act(m_.fmt) || !is_act(m_.norm_fmt) || !is_act(m_.kv_fmt)) bad("activations, norms and the KV cache must be f32, f16 or bf16");
    if (!m_.H || !m_.Hq || !m_.Hkv || !m_.D || !m_.E || !m_.K || m_.K > m_.E) bad("empty shape or top-k above the experts");
    if (m_.Hq % m_.Hkv) bad("query heads must be a multiple of the kv heads");
    if (!m_.final_norm || !m_.cos || !m_.sin_signed || !m_.max_pos || !m_.num_blocks || !m_.block_size)
        bad("no final norm, rotary tables or KV cache geometry");
    const uint32_t qkv_rows = (m_.Hq + 2 * m_.Hkv) * m_.D;
    for (size_t i = 0; i < m_.layers.size(); ++i) {
        const DecodeLayer& L = m_.layers[i];
        if (!L.in_norm || !L.post_norm || !L.q_norm || !L.k_norm || !L.k_cache || !L.v_cache)
            bad("layer " + std::to_string(i) + ": a norm weight or a KV cache is missing");
        if (L.qkv.empty() || L.qkv.size() != L.qkv_col.size()) bad("layer " + std::to_string(i) + ": no q/k/v matrices");
        uint64_t col = 0;
        for (size_t j = 0; j < L.qkv.size(); ++j) {
            if (!L.qkv[j] || L.qkv_col[j] != col) bad("layer " + std::to_string(i) + ": q/k/v pieces not side by side");
            check_weight(L.qkv[j], L.qkv[j]->rows, m_.H, i, "q/k/v");
            col += L.qkv[j]->rows;
        }
        if (col != qkv_rows)
            bad("layer " + std::to_string(i) + ": q/k/v have " + std::to_string(col) + " rows, expected " +
                std::to_string(qkv_rows));
        check_weight(L.o, m_.H, m_.Hq * m_.D, i, "o");
        check_weight(L.router, m_.E, m_.H, i, "router");
        if (L.router->format != FT_FMT_F32) bad("layer " + std::to_string(i) + ": the router must be float32");
        if (!L.bank) bad("layer " + std::to_string(i) + ": no expert bank");
        validate_bank(*L.bank);
        if (L.bank->num_experts != m_.E || L.bank->hidden != m_.H)
            bad("layer " + std::to_string(i) + ": the expert bank does not match the router or the hidden size");
    }
}

void DecodeStep::run(const DecodeStepIO& io, Pool& pool, const KernelTable& k) {
    const DecodeModel& m = m_;
    const uint32_t T = io.T;
    if (!T || !io.embed || !io.out || !io.positions || !io.slots) throw std::invalid_argument("decode step: no tokens or a null buffer");
    const size_t es = esize(m.fmt);
    const uint32_t HqD = m.Hq * m.D, qkv_rows = (m.Hq + 2 * m.Hkv) * m.D;
    // scratch: h, x, qkv, q, attention, o, delta (activations), logits, w (f32), ids (i32)
    const size_t sz[] = {T * m.H * es, T * m.H * es, T * qkv_rows * es, T * HqD * es, T * HqD * es,
                         T * m.H * es, T * m.H * es, (size_t)T * m.E * 4, (size_t)T * m.K * 4, (size_t)T * m.K * 4};
    constexpr int kBufs = sizeof(sz) / sizeof(sz[0]);
    size_t total = 64;
    for (size_t s : sz) total += align64(s);
    if (ws_.size() < total) ws_.resize(total);
    uint8_t* p = (uint8_t*)(((uintptr_t)ws_.data() + 63) & ~(uintptr_t)63);
    uint8_t* buf[kBufs];
    for (int i = 0; i < kBufs; ++i) {
        buf[i] = p;
        p += align64(sz[i]);
    }
    uint8_t *h = buf[0], *x = buf[1], *qkv = buf[2], *q = buf[3], *attn = buf[4], *o = buf[5], *delta = buf[6];
    float* logits = (float*)buf[7];
    float* w = (float*)buf[8];
    int32_t* ids = (int32_t*)buf[9];

    using clock = std::chrono::steady_clock;
    const bool prof = profile;
    clock::time_point t0 = prof ? clock::now() : clock::time_point();
    auto lap = [&](int part) {
        if (!prof) return;
        const clock::time_point t1 = clock::now();
        part_ns[part] += (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
        t0 = t1;
    };

    QkRopeCall qk;
    qk.q = qkv;
    qk.k = qkv + (size_t)HqD * es;
    qk.v = qkv + (size_t)(HqD + m.Hkv * m.D) * es;
    qk.q_tok = qk.k_tok = qk.v_tok = qkv_rows;
    qk.fmt = m.fmt;
    qk.T = T;
    qk.Hq = m.Hq;
    qk.Hkv = m.Hkv;
    qk.D = m.D;
    qk.w_fmt = m.norm_fmt;
    qk.eps = m.eps;
    qk.cos = m.cos;
    qk.sin_signed = m.sin_signed;
    qk.max_pos = m.max_pos;
    qk.positions = io.positions;
    qk.slots = io.slots;
    qk.kv_fmt = m.kv_fmt;
    qk.num_slots = (uint64_t)m.num_blocks * m.block_size;
    qk.q_out = q;

    AttnCall at;
    at.q = q;
    at.q_fmt = m.fmt;
    at.q_tok = HqD;
    at.q_head = m.D;
    at.kv_fmt = m.kv_fmt;
    at.num_blocks = m.num_blocks;
    at.block_size = m.block_size;
    at.num_kv_heads = m.Hkv;
    at.head_dim = m.D;
    at.num_heads = m.Hq;
    at.num_seqs = io.num_seqs;
    at.q_start = io.q_start;
    at.q_len = io.q_len;
    at.ctx_len = io.ctx_len;
    at.block_table = io.block_table;
    at.bt_stride = io.bt_stride;
    at.num_tokens = T;
    at.out = attn;
    at.out_fmt = m.fmt;
    at.scale = m.scale;

    MoeCall moe;
    moe.x = x;
    moe.x_fmt = m.fmt;
    moe.ids = ids;
    moe.w = w;
    moe.T = T;
    moe.K = m.K;
    moe.y = delta;
    moe.y_fmt = m.fmt;

    for (size_t l = 0; l < m.layers.size(); ++l) {
        const DecodeLayer& L = m.layers[l];
        if (l == 0)
            add_rms_norm(io.embed, nullptr, L.in_norm, m.norm_fmt, h, x, m.fmt, T, m.H, m.eps);
        else
            add_rms_norm(h, delta, L.in_norm, m.norm_fmt, h, x, m.fmt, T, m.H, m.eps);
        lap(kPartOther);
        linear_group(L.qkv.data(), (uint32_t)L.qkv.size(), x, m.fmt, T, qkv, m.fmt, qkv_rows, L.qkv_col.data(), pool, k);
        lap(kPartQkv);
        qk.q_w = L.q_norm;
        qk.k_w = L.k_norm;
        qk.k_cache = L.k_cache;
        qk.v_cache = L.v_cache;
        qk_norm_rope_store(qk);
        lap(kPartOther);
        at.k_cache = L.k_cache;
        at.v_cache = L.v_cache;
        paged_attention(at, pool, k);
        lap(kPartAttention);
        linear_forward(*L.o, attn, m.fmt, T, o, m.fmt, false, pool, k);
        lap(kPartOProj);
        add_rms_norm(h, o, L.post_norm, m.norm_fmt, h, x, m.fmt, T, m.H, m.eps);
        lap(kPartOther);
        linear_forward(*L.router, x, m.fmt, T, logits, FT_FMT_F32, false, pool, k);
        lap(kPartRouter);
        router_top_k(logits, T, m.E, m.K, m.norm_topk, ids, w);
        lap(kPartOther);
        moe.bank = L.bank;
        moe_forward(moe, pool, k);
        lap(kPartExperts);
    }
    if (m.layers.empty())
        add_rms_norm(io.embed, nullptr, m.final_norm, m.norm_fmt, h, io.out, m.fmt, T, m.H, m.eps);
    else
        add_rms_norm(h, delta, m.final_norm, m.norm_fmt, h, io.out, m.fmt, T, m.H, m.eps);
    lap(kPartOther);
    if (prof) ++steps;
}

}  // namespace ft
