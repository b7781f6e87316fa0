// Kernel table of the "scalar" tier (compiled with this tier's flags, see setup.py).
#define FT_ISA_NS isa_scalar
#define FT_ISA_NAME "scalar"

#include "kernels_isa.inc"

const ft::KernelTable* ft::kernels_scalar() { return &ft::isa_scalar::kTable; }
