// freetoken_cuda._C: the shared GPU surface (freetoken/gpu/*.cuh from freetoken-core) built with nvcc.
#include <freetoken/gpu/module_bindings.cuh>

PYBIND11_MODULE(_C, m) { freetoken_gpu::bind_module(m); }
