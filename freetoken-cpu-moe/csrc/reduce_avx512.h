// Horizontal sums of up to 16 AVX-512 vectors at once (a transposing add tree:
// ~3 instructions per vector instead of ~9 for one _mm512_reduce_add_ps each).
// Included inside an ISA namespace by isa_avx512.cpp.
#pragma once

static inline void hsum16_avx512(const __m512* v, int n, float* out) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = i < n ? v[i] : _mm512_setzero_ps();
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of 4 vectors
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    if (n == 16) {
        _mm512_storeu_ps(out, w);
    } else {
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1u), w);
    }
}
