// The row walk both tile kernels of the AVX2 tiers share (kquant_tiles_avx2.h,
// block32_tiles_avx2.h): rows in groups of 8, every block of a group handed to the format's
// unpacking (the group's last row repeated where fewer than 8 are left), the next group's
// rows prefetched meanwhile (8 streams at once are more than the hardware prefetchers follow,
// and one call may be all a matrix sees), and each token's 8 lanes stored to its output row.
// Included inside an ISA namespace by isa_*.cpp.
#pragma once

// For the rows [g, min(g + 8, r1)) of the matrix at base: unpack(blk, b) for every block
// b < nb, blk[r] the block of row r (BB bytes per block).
template <size_t BB, class Unpack>
static inline void unpack_row_group8(const uint8_t* base, size_t row_stride, uint32_t g, uint32_t r1, uint32_t nb,
                                     Unpack&& unpack) {
    const uint32_t n = std::min(8u, r1 - g);
    const uint8_t* rows[8];
    for (uint32_t r = 0; r < 8; ++r) rows[r] = base + (size_t)(g + std::min(r, n - 1)) * row_stride;
    const uint32_t nn = g + 8 < r1 ? std::min(8u, r1 - g - 8) : 0;
    const uint8_t* next = base + (size_t)(g + 8) * row_stride;
    for (uint32_t b = 0; b < nb; ++b) {
        const uint8_t* blk[8];
        for (int r = 0; r < 8; ++r) blk[r] = rows[r] + (size_t)b * BB;
        for (uint32_t r = 0; r < nn; ++r)
            for (size_t o = 0; o < BB; o += 64)
                _mm_prefetch((const char*)next + (size_t)r * row_stride + (size_t)b * BB + o, _MM_HINT_T0);
        unpack(blk, b);
    }
}

// o[0..n) = the first n lanes of v (n <= 8)
static inline void store_row_group8(float* o, __m256 v, uint32_t n) {
    if (n == 8) {
        _mm256_storeu_ps(o, v);
        return;
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (uint32_t r = 0; r < n; ++r) o[r] = tmp[r];
}
