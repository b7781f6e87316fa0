// freetoken_rocm._C: the shared GPU surface (freetoken/gpu/*.cuh from freetoken-core) built with hipcc.
#ifndef FT_GPU_HIP
#define FT_GPU_HIP 1
#endif
#include <freetoken/gpu/module_bindings.cuh>

PYBIND11_MODULE(_C, m) { freetoken_gpu::bind_module(m); }
