// AVX-512 VNNI K-quant kernels (placeholder: portable path until the SIMD kernels land).
#pragma once
template <int FMT>
static void dot_rows_kquant_avx512(const ft_weight_desc& w, uint32_t e, uint32_t r0, uint32_t r1,
                                   const void* const* xs, uint32_t ntok, float* out, size_t os) {
    dot_rows_kquant_portable<FMT>(w, e, r0, r1, xs, ntok, out, os);
}
