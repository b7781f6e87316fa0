#include "deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "act_rows.h"
#include "dispatch.h"
#include "fp_env.h"

namespace ft {
namespace {

using namespace act_rows;

float rounded(uint32_t fmt, float v) {
    round_to(fmt, &v, 1);
    return v;
}

// torch.nn.functional.softplus (beta 1, threshold 20)
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// ---- per-tier bodies: plain loops the compiler vectorises with the flags of the function
// they are inlined into (head_step_<tier>, silu_<tier> below)

// exp(t) for t in [-87, 88] (clamped): Cephes' expf polynomial, ~1 ulp, branch-free
__attribute__((always_inline)) inline float exp_poly(float t) {
    t = t < -87.0f ? -87.0f : (t > 88.0f ? 88.0f : t);
    const float fx = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const float z = (t - fx * 0.693359375f) - fx * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * z + 1.3981999507e-3f;
    p = p * z + 8.3334519073e-3f;
    p = p * z + 4.1665795894e-2f;
    p = p * z + 1.6666665459e-1f;
    p = p * z + 5.0000001201e-1f;
    p = p * z * z + z + 1.0f;
    const int32_t e = ((int32_t)fx + 127) << 23;
    float s;
    std::memcpy(&s, &e, 4);
    return p * s;
}

// x[i] = silu(x[i]) = x[i] / (1 + exp(-x[i]))
__attribute__((always_inline)) inline void silu_body(float* x, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + exp_poly(-x[i]));
}

// One value head of one token: the gated delta rule on its state S [dk][dv] (in place),
// o = decay q^T S + (q . k) delta with delta = beta (v - decay k^T S), then
// S <- decay S + k delta^T. qs and ks: scratch [dv]. Written so the compiler vectorises the
// loops over dv with the flags of the function it is inlined into.
__attribute__((always_inline)) inline void head_step_body(float* S, const float* q, const float* k, const float* v,
                                                          float decay, float beta, float* o, uint32_t dk, uint32_t dv,
                                                          float* qs, float* ks) {
    for (uint32_t j = 0; j < dv; ++j) qs[j] = ks[j] = 0.0f;
    float qk = 0.0f;
    for (uint32_t i = 0; i < dk; ++i) {
        const float qi = q[i], ki = k[i];
        const float* row = S + (size_t)i * dv;
        for (uint32_t j = 0; j < dv; ++j) {
            qs[j] += qi * row[j];
            ks[j] += ki * row[j];
        }
        qk += qi * ki;
    }
    for (uint32_t j = 0; j < dv; ++j) {
        const float d = (v[j] - decay * ks[j]) * beta;
        o[j] = decay * qs[j] + qk * d;
        ks[j] = d;
    }
    for (uint32_t i = 0; i < dk; ++i) {
        const float ki = k[i];
        float* row = S + (size_t)i * dv;
        for (uint32_t j = 0; j < dv; ++j) row[j] = row[j] * decay + ki * ks[j];
    }
}

using HeadStep = void (*)(float*, const float*, const float*, const float*, float, float, float*, uint32_t, uint32_t,
                          float*, float*);

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void head_step_avx512(
    float* S, const float* q, const float* k, const float* v, float decay, float beta, float* o, uint32_t dk,
    uint32_t dv, float* qs, float* ks) {
    head_step_body(S, q, k, v, decay, beta, o, dk, dv, qs, ks);
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void silu_avx512(float* x, uint32_t n) {
    silu_body(x, n);
}

__attribute__((target("avx2,fma"))) void silu_avx2(float* x, uint32_t n) { silu_body(x, n); }

__attribute__((target("avx2,fma"))) void head_step_avx2(float* S, const float* q, const float* k, const float* v,
                                                        float decay, float beta, float* o, uint32_t dk, uint32_t dv,
                                                        float* qs, float* ks) {
    head_step_body(S, q, k, v, decay, beta, o, dk, dv, qs, ks);
}
#endif

void head_step_scalar(float* S, const float* q, const float* k, const float* v, float decay, float beta, float* o,
                      uint32_t dk, uint32_t dv, float* qs, float* ks) {
    head_step_body(S, q, k, v, decay, beta, o, dk, dv, qs, ks);
}

void silu_scalar(float* x, uint32_t n) { silu_body(x, n); }

struct Tier {
    HeadStep head_step;
    void (*silu)(float*, uint32_t);
};

// the tier of the kernel table in use (freetoken_cpu_moe.set_isa applies here too)
Tier tier_for(const KernelTable& k) {
#if defined(__x86_64__)
    const std::string name(k.name);
    if (name == "amx" || name == "avx512") return {head_step_avx512, silu_avx512};
    if (name == "avx2" || name == "avx_vnni") return {head_step_avx2, silu_avx2};
#endif
    (void)k;
    return {head_step_scalar, silu_scalar};
}

// channels per item of the convolution phase
constexpr uint32_t kConvChunk = 1024;

void validate(const DeltaNetDecodeCall& c) {
    auto bad = [](const std::string& why) { throw std::invalid_argument("deltanet_decode: " + why); };
    if (!is_act(c.fmt) || !is_act(c.conv_fmt) || !is_act(c.conv_w_fmt) || !is_act(c.norm_fmt))
        bad("activations, conv state and weights must be f32, f16 or bf16");
    if (!c.mixed || !c.z || !c.b || !c.a || !c.conv_w || !c.A || !c.dt_bias || !c.norm_w || !c.slots ||
        !c.conv_state || !c.ssm_state || !c.out)
        bad("null buffer");
    if (!c.key_heads || !c.value_heads || !c.key_dim || !c.value_dim || c.conv_kernel < 2)
        bad("empty shape or a convolution kernel shorter than 2");
    if (c.value_heads % c.key_heads)
        bad(std::to_string(c.value_heads) + " value heads are not a multiple of " + std::to_string(c.key_heads) +
            " key heads");
    const uint64_t channels = 2ull * c.key_heads * c.key_dim + (uint64_t)c.value_heads * c.value_dim;
    if (c.mixed_tok < channels || c.z_tok < (uint64_t)c.value_heads * c.value_dim || c.b_tok < c.value_heads ||
        c.a_tok < c.value_heads)
        bad("input rows shorter than their channels");
    for (uint32_t t = 0; t < c.T; ++t) {
        if (c.slots[t] < 0 || (uint64_t)c.slots[t] >= c.num_slots)
            bad("state slot " + std::to_string(c.slots[t]) + " out of range [0, " + std::to_string(c.num_slots) + ")");
        for (uint32_t u = 0; u < t; ++u)
            if (c.slots[u] == c.slots[t]) bad("state slot " + std::to_string(c.slots[t]) + " given to two tokens");
    }
}

}  // namespace

void deltanet_decode(const DeltaNetDecodeCall& c, Pool& pool) {
    FlushDenormalsScope ftz;
    validate(c);
    const uint32_t T = c.T, Hk = c.key_heads, Hv = c.value_heads, dk = c.key_dim, dv = c.value_dim;
    const uint32_t K = c.conv_kernel, kd = Hk * dk, C = 2 * kd + Hv * dv;
    const size_t es = esize(c.fmt), cs = esize(c.conv_fmt);
    const Tier tier = tier_for(*active_kernels());
    std::vector<float> conv((size_t)T * C);  // silu(conv) of each token's channels, rounded to fmt
    std::vector<float> w_f32, nw(dv);
    const float* w = (const float*)c.conv_w;
    if (c.conv_w_fmt != FT_FMT_F32) {
        w_f32.resize((size_t)C * K);
        load(c.conv_w_fmt, c.conv_w, w_f32.data(), (uint32_t)w_f32.size());
        w = w_f32.data();
    }
    load(c.norm_fmt, c.norm_w, nw.data(), dv);
    const uint32_t chunks = (C + kConvChunk - 1) / kConvChunk;
    // ---- phase 1, items (token, chunk of channels): the convolution over the window of the
    // K - 1 stored inputs and this one, SiLU; the window shifted by one input
    auto conv_item = [&](int item, int) {
        thread_local std::vector<float> win;
        const uint32_t t = (uint32_t)item / chunks, c0 = ((uint32_t)item % chunks) * kConvChunk;
        const uint32_t n = std::min(kConvChunk, C - c0);
        win.resize((size_t)K * n);
        uint8_t* st = (uint8_t*)c.conv_state + (size_t)c.slots[t] * (K - 1) * C * cs;
        for (uint32_t j = 0; j + 1 < K; ++j) load(c.conv_fmt, st + ((size_t)j * C + c0) * cs, &win[(size_t)j * n], n);
        float* x = &win[(size_t)(K - 1) * n];
        load(c.fmt, (const uint8_t*)c.mixed + ((size_t)t * c.mixed_tok + c0) * es, x, n);
        round_to(c.conv_fmt, x, n);
        float* out = conv.data() + (size_t)t * C + c0;
        for (uint32_t i = 0; i < n; ++i) {
            const float* wc = w + (size_t)(c0 + i) * K;
            float acc = 0.0f;
            for (uint32_t j = 0; j < K; ++j) acc += win[(size_t)j * n + i] * wc[j];
            out[i] = acc;
        }
        tier.silu(out, n);
        round_to(c.fmt, out, n);
        for (uint32_t j = 0; j + 1 < K; ++j) save(c.conv_fmt, st + ((size_t)j * C + c0) * cs, &win[(size_t)(j + 1) * n], n);
    };
    // ---- phase 2, items value heads (each over the tokens in order): q/k of its key head
    // normalised, the gates, the recurrence, the gated RMSNorm
    const uint32_t rep = Hv / Hk;
    const float q_scale = 1.0f / std::sqrt((float)dk);
    auto head_item = [&](int item, int) {
        thread_local std::vector<float> scratch;
        scratch.resize(2 * (size_t)dk + 4 * (size_t)dv);
        float* q = scratch.data();
        float* k = q + dk;
        float* o = k + dk;
        float* qs = o + dv;
        float* ks = qs + dv;
        float* zs = ks + dv;
        const uint32_t h = (uint32_t)item, kh = c.tiled ? h % Hk : h / rep;
        for (uint32_t t = 0; t < T; ++t) {
            const float* ct = conv.data() + (size_t)t * C;
            float sq = 0.0f, sk = 0.0f;  // x / sqrt(|x|^2 + 1e-6), q also by 1 / sqrt(dk)
            for (uint32_t i = 0; i < dk; ++i) {
                q[i] = ct[(size_t)kh * dk + i];
                k[i] = ct[kd + (size_t)kh * dk + i];
                sq += q[i] * q[i];
                sk += k[i] * k[i];
            }
            const float rq = 1.0f / std::sqrt(sq + 1e-6f) * q_scale, rk = 1.0f / std::sqrt(sk + 1e-6f);
            for (uint32_t i = 0; i < dk; ++i) {
                q[i] *= rq;
                k[i] *= rk;
            }
            float bv, av;
            load(c.fmt, (const uint8_t*)c.b + ((size_t)t * c.b_tok + h) * es, &bv, 1);
            load(c.fmt, (const uint8_t*)c.a + ((size_t)t * c.a_tok + h) * es, &av, 1);
            const float beta = rounded(c.fmt, 1.0f / (1.0f + std::exp(-bv)));
            const float decay = std::exp(c.A[h] * softplus(av + c.dt_bias[h]));
            float* S = c.ssm_state + ((size_t)c.slots[t] * Hv + h) * dk * dv;
            tier.head_step(S, q, k, ct + 2 * kd + (size_t)h * dv, decay, beta, o, dk, dv, qs, ks);
            // gated RMSNorm: rms(o in fmt) * w, times silu(z); rounded where the torch form stores
            round_to(c.fmt, o, dv);
            float ss = 0.0f;
            for (uint32_t j = 0; j < dv; ++j) ss += o[j] * o[j];
            const float r = 1.0f / std::sqrt(ss / (float)dv + c.eps);
            for (uint32_t j = 0; j < dv; ++j) o[j] *= r;
            round_to(c.fmt, o, dv);
            for (uint32_t j = 0; j < dv; ++j) o[j] *= nw[j];
            round_to(c.fmt, o, dv);
            load(c.fmt, (const uint8_t*)c.z + ((size_t)t * c.z_tok + (size_t)h * dv) * es, zs, dv);
            tier.silu(zs, dv);
            for (uint32_t j = 0; j < dv; ++j) o[j] *= zs[j];
            save(c.fmt, (uint8_t*)c.out + ((size_t)t * Hv + h) * dv * es, o, dv);
        }
    };
    pool.run_phases({{(int)(T * chunks), conv_item}, {(int)Hv, head_item}});
}

}  // namespace ft
