// Expert activations applied to (gate, up) rows, in float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "freetoken/handoff.h"

namespace ft {

struct ActParams {
    uint32_t kind = FT_ACT_SILU;
    float alpha = 1.702f;
    float limit = 7.0f;
};

// h[i] = act(g[i], u[i]) for i < n (h may alias g)
inline void apply_activation(const ActParams& a, float* h, const float* g, const float* u, uint32_t n) {
    switch (a.kind) {
        case FT_ACT_SILU:
            for (uint32_t i = 0; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
            break;
        case FT_ACT_GELU_TANH: {
            const float k0 = 0.7978845608028654f, k1 = 0.044715f;
            for (uint32_t i = 0; i < n; ++i) {
                const float x = g[i];
                h[i] = 0.5f * x * (1.0f + std::tanh(k0 * (x + k1 * x * x * x))) * u[i];
            }
            break;
        }
        case FT_ACT_SWIGLU_OAI:
            for (uint32_t i = 0; i < n; ++i) {
                const float x = g[i] < a.limit ? g[i] : a.limit;
                float v = u[i] < a.limit ? u[i] : a.limit;
                v = v > -a.limit ? v : -a.limit;
                h[i] = (v + 1.0f) * x / (1.0f + std::exp(-a.alpha * x));
            }
            break;
        default:
            break;
    }
}

}  // namespace ft
