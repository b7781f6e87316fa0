// Attention kernel of the "avx2" tier (compiled with this tier's flags, see setup.py).
#include <algorithm>

#define FT_ATTN_NS attn_avx2
#define FT_HAVE_AVX2 1
#include "attention_isa.inc"

const ft::AttnKernels* ft::attn_kernels_avx2() { return &ft::attn_avx2::kAttn; }
