// The int8 dot-product step of the AVX2 tiers: unsigned bytes u times signed bytes s, the
// four products of each dword lane summed into that int32 lane. The avx2 tier forms it
// from vpmaddubsw (adjacent pairs into int16, saturating) and vpmaddwd with ones; the
// avx_vnni tier has it as one instruction, AVX-VNNI's vpdpbusd (exact in int32, and it
// accumulates). Both give the same int32 sums as long as no pair of products leaves int16,
// i.e. u <= 128 where |s| <= 127 (the activations' codes never reach -128): every caller's
// weight codes stay below that, so the two tiers agree bit for bit on every sum.
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

// sums of the four u x s products of each dword lane
static inline __m256i dot4_u8i8(__m256i u, __m256i s) {
#if defined(FT_HAVE_AVX_VNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
