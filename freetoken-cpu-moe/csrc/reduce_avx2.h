// Horizontal sums of the AVX2 tiers (avx2, avx_vnni). Included inside an ISA namespace by
// isa_*.cpp and attention_avx2.cpp.
#pragma once

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Lane i of the result = the sum of v[i]'s lanes (8 vectors at once).
static inline __m256 hsum8_ps(const __m256* v) {
    __m256 s[4], t[2];
    for (int i = 0; i < 4; ++i)  // per lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        s[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // per lane: the 4 vectors' partial sums
        t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
}

// dword i of 128-bit lane h of the result = the sum of the dwords 4 h .. 4 h + 3 of p[i]
// (four vectors' sums per 128-bit lane, by unpacks and adds: no cross-lane moves).
static inline __m256i sum4_epi32(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
    const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}
