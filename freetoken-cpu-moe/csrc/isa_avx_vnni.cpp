// Kernel table of the "avx_vnni" tier: the avx2 tier's kernels, with the int8 dot products
// of the quantized formats on AVX-VNNI's 256-bit vpdpbusd (compiled with this tier's flags,
// see setup.py).
#define FT_ISA_NS isa_avx_vnni
#define FT_ISA_NAME "avx_vnni"
#define FT_HAVE_AVX2 1
#define FT_HAVE_AVX_VNNI 1
#include "kernels_isa.inc"

const ft::KernelTable* ft::kernels_avx_vnni() { return &ft::isa_avx_vnni::kTable; }
