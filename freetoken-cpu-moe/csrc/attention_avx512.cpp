// Attention kernel of the "avx512" tier (compiled with this tier's flags, see setup.py).
#include <algorithm>

#define FT_ATTN_NS attn_avx512
#define FT_HAVE_AVX512 1
#include "attention_isa.inc"

const ft::AttnKernels* ft::attn_kernels_avx512() { return &ft::attn_avx512::kAttn; }
