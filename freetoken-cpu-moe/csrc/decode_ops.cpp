#include "decode_ops.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "act_rows.h"
#include "fp_env.h"

namespace ft {
namespace {

using namespace act_rows;

// y = x * rsqrt(mean(x^2) + eps) (* w when w)
void rms(const float* x, const float* w, float* y, uint32_t n, float eps) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * x[i + l];
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / (float)n + eps);
    if (w)
        for (uint32_t j = 0; j < n; ++j) y[j] = x[j] * r * w[j];
    else
        for (uint32_t j = 0; j < n; ++j) y[j] = x[j] * r;
}

struct Tls {
    std::vector<float> a, b, c, w1, w2;
};
thread_local Tls tls;

}  // namespace

void add_rms_norm(const void* h, const void* delta, const void* w, uint32_t w_fmt, void* h_out, void* x_out,
                  uint32_t fmt, uint32_t T, uint32_t n, float eps) {
    FlushDenormalsScope ftz;
    if (!is_act(fmt) || !is_act(w_fmt)) throw std::invalid_argument("add_rms_norm: activations must be f32, f16 or bf16");
    if (!h || !w || !h_out || !x_out || n == 0) throw std::invalid_argument("add_rms_norm: null buffer or empty row");
    if (fmt == FT_FMT_F32 && w_fmt == FT_FMT_F32) {  // in place, one pass for the sum and its squares
        const float* wf = (const float*)w;
        for (uint32_t t = 0; t < T; ++t) {
            const float* hp = (const float*)h + (size_t)t * n;
            float* ho = (float*)h_out + (size_t)t * n;
            float* xo = (float*)x_out + (size_t)t * n;
            float acc[16] = {};
            uint32_t i = 0;
            if (delta) {
                const float* dp = (const float*)delta + (size_t)t * n;
                for (; i + 16 <= n; i += 16)
                    for (int l = 0; l < 16; ++l) {
                        const float v = hp[i + l] + dp[i + l];
                        ho[i + l] = v;
                        acc[l] += v * v;
                    }
                for (; i < n; ++i) {
                    ho[i] = hp[i] + dp[i];
                    acc[0] += ho[i] * ho[i];
                }
            } else {
                if (ho != hp) std::memcpy(ho, hp, (size_t)n * 4);
                for (; i + 16 <= n; i += 16)
                    for (int l = 0; l < 16; ++l) acc[l] += hp[i + l] * hp[i + l];
                for (; i < n; ++i) acc[0] += hp[i] * hp[i];
            }
            float ss = 0.0f;
            for (int l = 0; l < 16; ++l) ss += acc[l];
            const float r = 1.0f / std::sqrt(ss / (float)n + eps);
            for (uint32_t j = 0; j < n; ++j) xo[j] = ho[j] * r * wf[j];
        }
        return;
    }
    Tls& s = tls;
    s.a.resize(n);
    s.b.resize(n);
    s.w1.resize(n);
    load(w_fmt, w, s.w1.data(), n);
    const size_t row = (size_t)n * esize(fmt);
    for (uint32_t t = 0; t < T; ++t) {
        load(fmt, (const uint8_t*)h + t * row, s.a.data(), n);
        if (delta) {
            load(fmt, (const uint8_t*)delta + t * row, s.b.data(), n);
            for (uint32_t i = 0; i < n; ++i) s.a[i] += s.b[i];
            round_to(fmt, s.a.data(), n);
            save(fmt, (uint8_t*)h_out + t * row, s.a.data(), n);
        } else if (h_out != h) {
            std::memcpy((uint8_t*)h_out + t * row, (const uint8_t*)h + t * row, row);
        }
        rms(s.a.data(), s.w1.data(), s.b.data(), n, eps);
        save(fmt, (uint8_t*)x_out + t * row, s.b.data(), n);
    }
}

void qk_norm_rope_store(const QkRopeCall& c) {
    FlushDenormalsScope ftz;
    auto bad = [](const std::string& why) { throw std::invalid_argument("qk_norm_rope_store: " + why); };
    if (!is_act(c.fmt) || !is_act(c.kv_fmt) || !is_act(c.w_fmt)) bad("tensors must be f32, f16 or bf16");
    if (!c.q || !c.k || !c.v || !c.cos || !c.sin_signed || !c.positions || !c.slots || !c.k_cache || !c.v_cache ||
        !c.q_out)
        bad("null buffer");
    if (!c.D || c.D % 2 || !c.Hq || !c.Hkv) bad("head_dim must be even and the head counts positive");
    if ((c.q_w == nullptr) != (c.k_w == nullptr)) bad("q and k norm weights: both or neither");
    const uint32_t D = c.D, half = D / 2;
    for (uint32_t t = 0; t < c.T; ++t) {
        if (c.positions[t] < 0 || (uint64_t)c.positions[t] >= c.max_pos)
            bad("position " + std::to_string(c.positions[t]) + " outside the rotary table's " +
                std::to_string(c.max_pos) + " positions");
        if (c.slots[t] < 0 || (uint64_t)c.slots[t] >= c.num_slots)
            bad("cache slot " + std::to_string(c.slots[t]) + " out of range [0, " + std::to_string(c.num_slots) + ")");
    }
    Tls& s = tls;
    s.a.resize(D);
    s.b.resize(D);
    s.c.resize(D);
    s.w1.resize(D);
    s.w2.resize(D);
    const float* qw = nullptr;
    const float* kw = nullptr;
    if (c.q_w) {
        load(c.w_fmt, c.q_w, s.w1.data(), D);
        load(c.w_fmt, c.k_w, s.w2.data(), D);
        qw = s.w1.data();
        kw = s.w2.data();
    }
    const size_t es = esize(c.fmt), kvs = esize(c.kv_fmt);
    // one head: load, add the bias, norm, rotate, store to dst in dst_fmt
    // (float32 activations are read in place and a float32 destination written in place)
    auto head = [&](const void* src, const float* b, const float* w, const float* cs, const float* sn, void* dst,
                    uint32_t dst_fmt) {
        const float* x;
        if (c.fmt == FT_FMT_F32 && !b) {
            x = (const float*)src;
        } else if (c.fmt == FT_FMT_F32) {
            const float* f = (const float*)src;
            for (uint32_t i = 0; i < D; ++i) s.a[i] = f[i] + b[i];
            x = s.a.data();
        } else {
            load(c.fmt, src, s.a.data(), D);
            if (b) {
                for (uint32_t i = 0; i < D; ++i) s.a[i] += b[i];
                round_to(c.fmt, s.a.data(), D);
            }
            x = s.a.data();
        }
        if (w) {
            rms(x, nullptr, s.b.data(), D, c.eps);
            for (uint32_t i = 0; i < D; ++i) s.b[i] *= w[i];
            round_to(c.fmt, s.b.data(), D);
            x = s.b.data();
        }
        float* y = dst_fmt == FT_FMT_F32 ? (float*)dst : s.c.data();
        for (uint32_t i = 0; i < half; ++i) y[i] = x[i] * cs[i] + x[i + half] * sn[i];
        for (uint32_t i = half; i < D; ++i) y[i] = x[i] * cs[i] + x[i - half] * sn[i];
        if (dst_fmt != FT_FMT_F32) save(dst_fmt, dst, y, D);
    };
    for (uint32_t t = 0; t < c.T; ++t) {
        const float* cs = c.cos + (size_t)c.positions[t] * D;
        const float* sn = c.sin_signed + (size_t)c.positions[t] * D;
        const uint8_t* qt = (const uint8_t*)c.q + (size_t)t * c.q_tok * es;
        const uint8_t* kt = (const uint8_t*)c.k + (size_t)t * c.k_tok * es;
        const uint8_t* vt = (const uint8_t*)c.v + (size_t)t * c.v_tok * es;
        for (uint32_t h = 0; h < c.Hq; ++h)
            head(qt + (size_t)h * D * es, c.q_b ? c.q_b + (size_t)h * D : nullptr, qw, cs, sn,
                 (uint8_t*)c.q_out + ((size_t)t * c.Hq + h) * D * es, c.fmt);
        const size_t slot = (size_t)c.slots[t] * c.Hkv * D;
        for (uint32_t h = 0; h < c.Hkv; ++h) {
            head(kt + (size_t)h * D * es, c.k_b ? c.k_b + (size_t)h * D : nullptr, kw, cs, sn,
                 (uint8_t*)c.k_cache + (slot + (size_t)h * D) * kvs, c.kv_fmt);
            load(c.fmt, vt + (size_t)h * D * es, s.a.data(), D);
            if (c.v_b) {
                for (uint32_t i = 0; i < D; ++i) s.a[i] += c.v_b[(size_t)h * D + i];
                round_to(c.fmt, s.a.data(), D);
            }
            save(c.kv_fmt, (uint8_t*)c.v_cache + (slot + (size_t)h * D) * kvs, s.a.data(), D);
        }
    }
}

void moe_bias_add(const void* y, uint64_t y_tok, uint32_t fmt, uint32_t T, uint32_t H, const int32_t* ids,
                  const float* w, uint32_t K, const float* bias, uint32_t E, void* out) {
    FlushDenormalsScope ftz;
    if (!is_act(fmt)) throw std::invalid_argument("moe_bias_add: activations must be f32, f16 or bf16");
    if (!y || !ids || !w || !bias || !out || H == 0) throw std::invalid_argument("moe_bias_add: null buffer or empty row");
    if (y_tok < H) throw std::invalid_argument("moe_bias_add: y rows shorter than H");
    for (uint64_t i = 0; i < (uint64_t)T * K; ++i)
        if (ids[i] >= (int32_t)E)
            throw std::invalid_argument("moe_bias_add: expert id " + std::to_string(ids[i]) + " out of range [0, " +
                                        std::to_string(E) + ")");
    Tls& s = tls;
    s.a.resize(H);
    const size_t es = esize(fmt);
    for (uint32_t t = 0; t < T; ++t) {
        // float32: accumulate in the output row itself
        float* acc = fmt == FT_FMT_F32 ? (float*)out + (size_t)t * H : s.a.data();
        load(fmt, (const uint8_t*)y + (size_t)t * y_tok * es, acc, H);
        for (uint32_t k = 0; k < K; ++k) {
            const int32_t e = ids[(size_t)t * K + k];
            if (e < 0) continue;
            const float wk = w[(size_t)t * K + k];
            const float* b = bias + (size_t)e * H;
            for (uint32_t i = 0; i < H; ++i) acc[i] += wk * b[i];
        }
        if (fmt != FT_FMT_F32) save(fmt, (uint8_t*)out + (size_t)t * H * es, acc, H);
    }
}

void router_top_k(const float* logits, uint32_t T, uint32_t E, uint32_t k, bool norm, int32_t* ids, float* w) {
    if (!logits || !ids || !w) throw std::invalid_argument("router_top_k: null buffer");
    if (k == 0 || k > E) throw std::invalid_argument("router_top_k: k=" + std::to_string(k) + " must be in [1, " +
                                                     std::to_string(E) + "]");
    std::vector<float> top(k);
    for (uint32_t t = 0; t < T; ++t) {
        const float* x = logits + (size_t)t * E;
        int32_t* it = ids + (size_t)t * k;
        float* wt = w + (size_t)t * k;
        uint32_t n = 0;  // insertion into the sorted top list
        for (uint32_t e = 0; e < E; ++e) {
            const float v = x[e];
            if (n == k && !(v > top[k - 1])) continue;
            uint32_t p = n < k ? n++ : k - 1;
            while (p > 0 && v > top[p - 1]) {
                top[p] = top[p - 1];
                it[p] = it[p - 1];
                --p;
            }
            top[p] = v;
            it[p] = (int32_t)e;
        }
        const float mx = top[0];
        float den = 0.0f;
        if (norm) {
            for (uint32_t j = 0; j < k; ++j) den += std::exp(top[j] - mx);
        } else {
            for (uint32_t e = 0; e < E; ++e) den += std::exp(x[e] - mx);
        }
        for (uint32_t j = 0; j < k; ++j) wt[j] = std::exp(top[j] - mx) / den;
    }
}

}  // namespace ft
