// GGUF Q8_0 weights (fp16 d + int8 qs[32] per 32 elements) against int8
// activation blocks. Included inside an ISA namespace by isa_*.cpp.
#pragma once

static inline int32_t dot_i8x32_portable(const int8_t* a, const int8_t* b) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

static void dot_rows_q8_0(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                          const void* const* xs, uint32_t ntok, float* out, size_t os) {
    const uint8_t* base = (const uint8_t*)(uintptr_t)w.data + (size_t)e * w.expert_stride;
    const uint32_t nb = w.cols / QK8_0;
    for (uint32_t r = r0; r < r1; ++r) {
        const uint8_t* row = base + (size_t)r * w.row_stride;
        for (uint32_t j = 0; j < ntok; ++j) {
            const BlockQ8x32* xb = (const BlockQ8x32*)xs[j];
            float acc = 0.0f;
#if defined(FT_HAVE_AVX512)
            __m512 vacc = _mm512_setzero_ps();
            uint32_t b = 0;
            // two blocks per step: 2 x 32 int8 in one 512-bit lane group
            for (; b + 2 <= nb; b += 2) {
                const uint8_t* p0 = row + (size_t)b * Q8_0_BYTES;
                const uint8_t* p1 = p0 + Q8_0_BYTES;
                __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(p0 + 2))),
                                                _mm256_loadu_si256((const __m256i*)(p1 + 2)), 1);
                __m512i xq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)xb[b].qs)),
                                                _mm256_loadu_si256((const __m256i*)xb[b + 1].qs), 1);
                // (w + 128) is unsigned: dpbusd, then remove 128 * sum(x)
                __m512i wu = _mm512_xor_si512(wq, _mm512_set1_epi8((char)0x80));
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xq);
                uint16_t h0, h1;
                std::memcpy(&h0, p0, 2);
                std::memcpy(&h1, p1, 2);
                const float d0 = half_to_float(h0) * xb[b].d, d1 = half_to_float(h1) * xb[b + 1].d;
                __m512 dv = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
                vacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, vacc);
                acc -= 128.0f * (d0 * (float)xb[b].qsum + d1 * (float)xb[b + 1].qsum);
            }
            acc += _mm512_reduce_add_ps(vacc);
            for (; b < nb; ++b) {
                const uint8_t* p = row + (size_t)b * Q8_0_BYTES;
                uint16_t h; std::memcpy(&h, p, 2);
                acc += half_to_float(h) * xb[b].d * (float)dot_i8x32_portable((const int8_t*)(p + 2), xb[b].qs);
            }
#else
            for (uint32_t b = 0; b < nb; ++b) {
                const uint8_t* p = row + (size_t)b * Q8_0_BYTES;
                uint16_t h; std::memcpy(&h, p, 2);
                acc += half_to_float(h) * xb[b].d * (float)dot_i8x32_portable((const int8_t*)(p + 2), xb[b].qs);
            }
#endif
            out[j * os + (r - r0)] = acc;
        }
    }
}
