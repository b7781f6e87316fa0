// The largest value of a row piece and where it first occurs, as numpy's argmax picks it
// (the first of equal values; -0 equals +0; a NaN counts as larger than any number, the
// first NaN wins), for linear_forward's greedy picks: each worker reduces the output rows
// it has just computed, while they are in its cache, and the caller combines the pieces.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common.h"

namespace ft {

struct RowBest {
    float value;     // the largest value (undefined when nan)
    uint32_t index;  // its first position in the row (the first NaN's when nan)
    uint32_t nan;    // the piece holds a NaN
};

// x[0..n) (n >= 1) whose first element is at position base of the row. Two passes: the
// largest value and whether any NaN, then the first position holding it; SSE2 (every
// x86-64 CPU) four vectors at a time, since this file is built for the baseline ISA and
// the compiler does not vectorise the loops with their NaN tests.
static inline RowBest row_best(const float* x, uint32_t n, uint32_t base) {
    float best = -std::numeric_limits<float>::infinity();
    uint32_t any_nan = 0, i = 0;
#if defined(__SSE2__)
    const uint32_t nv = n - n % 16;
    if (nv) {
        __m128 m[4], bad[4];
        for (int j = 0; j < 4; ++j) {
            m[j] = _mm_set1_ps(best);
            bad[j] = _mm_setzero_ps();
        }
        for (; i < nv; i += 16) {
            for (int j = 0; j < 4; ++j) {
                const __m128 v = _mm_loadu_ps(x + i + 4 * j);
                m[j] = _mm_max_ps(v, m[j]);  // v > m ? v : m: a NaN v keeps m
                bad[j] = _mm_or_ps(bad[j], _mm_cmpunord_ps(v, v));
            }
        }
        const __m128 m4 = _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3]));
        float lanes[4];
        _mm_storeu_ps(lanes, m4);
        for (float v : lanes) best = v > best ? v : best;
        any_nan = _mm_movemask_ps(_mm_or_ps(_mm_or_ps(bad[0], bad[1]), _mm_or_ps(bad[2], bad[3]))) != 0;
    }
#endif
    for (; i < n; ++i) {
        best = x[i] > best ? x[i] : best;
        any_nan |= x[i] != x[i];
    }
    if (any_nan) {
        for (i = 0; i < n; ++i)
            if (x[i] != x[i]) return {x[i], base + i, 1};
    }
    i = 0;
#if defined(__SSE2__)
    const __m128 b4 = _mm_set1_ps(best);
    for (; i + 4 <= n; i += 4) {
        const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), b4));
        if (hit) return {best, base + i + (uint32_t)__builtin_ctz((unsigned)hit), 0};
    }
#endif
    for (; i < n; ++i)
        if (x[i] == best) return {best, base + i, 0};
    return {best, base, 0};  // not reached: best is one of x
}

// The piece of a row that comes later (b, at higher positions than a) against a.
static inline RowBest row_best_merge(const RowBest& a, const RowBest& b) {
    if (a.nan) return a;
    if (b.nan) return b;
    return b.value > a.value ? b : a;
}

}  // namespace ft
