// Kernel table of the "amx" tier: the avx512 tier's kernels, and AMX tiles for calls
// with many tokens (compiled with this tier's flags, see setup.py).
#define FT_ISA_NS isa_amx
#define FT_ISA_NAME "amx"
#define FT_HAVE_AVX512 1
#define FT_HAVE_AMX 1
#include "kernels_isa.inc"

const ft::KernelTable* ft::kernels_amx() { return &ft::isa_amx::kTable; }
