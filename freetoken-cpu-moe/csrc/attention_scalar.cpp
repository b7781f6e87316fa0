// Attention kernel of the "scalar" tier (compiled with this tier's flags, see setup.py).
#include <algorithm>

#define FT_ATTN_NS attn_scalar

#include "attention_isa.inc"

const ft::AttnKernels* ft::attn_kernels_scalar() { return &ft::attn_scalar::kAttn; }
