"""The native GPU backend that freetoken-cuda and freetoken-rocm both are: the Python half
(:class:`~.backend.NativeGpuBackend`) over the native module each builds from
``freetoken/include/freetoken/gpu/``, its GpuSync modes (:mod:`.sync`), the packed GEMV and
routed-expert kernels (:mod:`.gemv`) and the KernelIO startup probe (:mod:`.kernel_io_probe`)."""
