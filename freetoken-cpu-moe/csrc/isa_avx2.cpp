// Kernel table of the "avx2" tier (compiled with this tier's flags, see setup.py).
#define FT_ISA_NS isa_avx2
#define FT_ISA_NAME "avx2"
#define FT_HAVE_AVX2 1
#include "kernels_isa.inc"

const ft::KernelTable* ft::kernels_avx2() { return &ft::isa_avx2::kTable; }
