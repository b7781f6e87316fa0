// The floating-point environment the kernels run in: subnormals flushed to zero
// (FTZ) and read as zero (DAZ). A subnormal operand costs an Intel core a microcode
// assist of ~100 cycles per instruction, so one subnormal-heavy weight or activation
// row can slow a kernel several-fold; values below 1.2e-38 do not matter to a model.
// Worker threads the package owns set it once; calls that compute on the caller's
// thread set it for their duration and restore the caller's own settings.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ft {

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kMxcsrFtzDaz = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)

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
#else
inline void set_flush_denormals() {}
class FlushDenormalsScope {};
#endif

}  // namespace ft
