// The floating-point environment the kernels run in: subnormals flushed to zero
// (FTZ) and read as zero (DAZ). A subnormal operand costs an Intel core a microcode
// assist of ~100 cycles per instruction, so one subnormal-heavy weight or activation
// row can slow a kernel several-fold; values below 1.2e-38 do not matter to a model.
// Worker threads the package owns set it once; calls that compute on the caller's
// thread set it for their duration and restore the caller's own settings. One kernel
// family reads subnormal inputs on purpose (DenormalInputsScope, below).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ft {

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kMxcsrFtz = 0x8000u;     // FTZ (bit 15): subnormal results become zero
constexpr unsigned kMxcsrDaz = 0x0040u;     // DAZ (bit 6): subnormal inputs read as zero
constexpr unsigned kMxcsrFtzDaz = kMxcsrFtz | kMxcsrDaz;

inline void set_flush_denormals() { _mm_setcsr(_mm_getcsr() | kMxcsrFtzDaz); }

class FlushDenormalsScope {
public:
    FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kMxcsrFtzDaz); }
    ~FlushDenormalsScope() { _mm_setcsr(saved_); }
    FlushDenormalsScope(const FlushDenormalsScope&) = delete;
    FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;

private:
    unsigned saved_;
};

// Subnormal inputs read as they are (DAZ off), results still flushed (FTZ on), for the
// duration of one kernel call; the previous MXCSR comes back after. For kernels whose
// operands are subnormal by design: the AVX2 FP8 kernels convert E4M3 codes to float32
// values 2^-120 times too small by bit moves alone, and every E4M3 subnormal code
// (exponent field 0) then lands in the float32 subnormal range. AMD cores read subnormal
// operands at full speed; Intel cores take a microcode assist for an FMA with a subnormal
// input (on real FP8 checkpoints ~1e-4 of the codes are subnormal).
class DenormalInputsScope {
public:
    DenormalInputsScope() : saved_(_mm_getcsr()) {
        const unsigned want = (saved_ | kMxcsrFtz) & ~kMxcsrDaz;
        if (want != saved_) _mm_setcsr(want);
    }
    ~DenormalInputsScope() {
        if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
    }
    DenormalInputsScope(const DenormalInputsScope&) = delete;
    DenormalInputsScope& operator=(const DenormalInputsScope&) = delete;

private:
    unsigned saved_;
};
#else
inline void set_flush_denormals() {}
class FlushDenormalsScope {};
class DenormalInputsScope {};
#endif

}  // namespace ft
