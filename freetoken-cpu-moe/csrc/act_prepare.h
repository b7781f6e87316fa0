// Preparation of float32 activations for the quantized dot products: symmetric
// int8 with a float scale per 32 elements (Q8_0 blocks; K-quant super-blocks of
// 256 also carry sums per 16 for the mins / the Q6_K offset, and the int8 values
// again in the AVX-512 kernels' register order).
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

static inline int8_t quant_round(float v) {
    // round half away from zero, as the reference rounding of the test comments assumes
    float r = v >= 0.0f ? v + 0.5f : v - 0.5f;
    int q = (int)r;
    q = q > 127 ? 127 : (q < -127 ? -127 : q);
    return (int8_t)q;
}

static inline float absmax_span(const float* x, uint32_t n) {
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) { float a = x[i + l] < 0 ? -x[i + l] : x[i + l]; m[l] = m[l] > a ? m[l] : a; }
    float r = 0.0f;
    for (int l = 0; l < 8; ++l) r = r > m[l] ? r : m[l];
    for (; i < n; ++i) { float a = x[i] < 0 ? -x[i] : x[i]; r = r > a ? r : a; }
    return r;
}

static void prepare_q8_32(const float* x, uint32_t n, void* out) {
    uint8_t* base = (uint8_t*)out;
    int8_t* qs = (int8_t*)base;
    float* d = (float*)(base + q8x32_d_offset(n));
    float* dq = d + n / 32;
    for (uint32_t b = 0; b < n / 32; ++b) {
        const float* xb = x + (size_t)b * 32;
        const float amax = absmax_span(xb, 32);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
            const int8_t q = quant_round(xb[i] * id);
            qs[(size_t)b * 32 + i] = q;
            sum += q;
        }
        d[b] = amax / 127.0f;
        dq[b] = d[b] * (float)sum;
    }
}

static void prepare_q8_k(const float* x, uint32_t n, BlockQ8xK* out) {
    for (uint32_t b = 0; b < n / 256; ++b) {
        BlockQ8xK& o = out[b];
        for (int s = 0; s < 8; ++s) {
            const float* xs = x + (size_t)b * 256 + 32 * s;
            const float amax = absmax_span(xs, 32);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < 32; ++i) o.qs[32 * s + i] = quant_round(xs[i] * id);
            o.d[s] = amax / 127.0f;
        }
        for (int g = 0; g < 16; ++g) {
            int sum = 0;
            for (int i = 0; i < 16; ++i) sum += o.qs[g * 16 + i];
            o.bsums[g] = (int16_t)sum;
            o.xs16[g] = o.d[g / 2] * (float)sum;
            o.dx16[g] = g % 8 >= 6 ? o.d[g / 2] * 0.25f : o.d[g / 2];
        }
        for (int s = 0; s < 8; ++s) {
            o.xs32[s] = o.d[s] * (float)((int)o.bsums[2 * s] + (int)o.bsums[2 * s + 1]);
            // odd sub-blocks are the high nibbles, which the kernels multiply as 16x
            // (Q4_K) or 8x (Q5_K) the code: exact powers of two, undone here
            o.xdm4[2 * s] = (s & 1) ? o.d[s] * 0.0625f : o.d[s];
            o.xdm5[2 * s] = (s & 1) ? o.d[s] * 0.125f : o.d[s];
            o.xdm4[2 * s + 1] = o.xdm5[2 * s + 1] = -o.xs32[s];
        }
        for (uint32_t i = 0; i < 256; ++i) o.qs4k[i] = o.qs[kq45_act_index(i)];
        for (int i = 0; i < 8; ++i) o.pad[i] = 0.0f;
    }
}

static void prepare_any(int kind, const float* x, uint32_t n, void* out) {
    switch (kind) {
        case ACT_F32: std::memcpy(out, x, (size_t)n * 4); break;
        case ACT_Q8_32: prepare_q8_32(x, n, out); break;
        case ACT_Q8_K: prepare_q8_k(x, n, (BlockQ8xK*)out); break;
        default: break;
    }
}
