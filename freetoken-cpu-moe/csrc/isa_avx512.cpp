// Kernel table of the "avx512" tier (compiled with this tier's flags, see setup.py).
#define FT_ISA_NS isa_avx512
#define FT_ISA_NAME "avx512"
#define FT_HAVE_AVX512 1
#include "kernels_isa.inc"

const ft::KernelTable* ft::kernels_avx512() { return &ft::isa_avx512::kTable; }
