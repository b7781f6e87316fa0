# Sourced with a llama.cpp build folder ($1): on a GPU machine where $1 has no llama-bench, the
# carried build (.bench/llama-cuda.tar.xz, tests/gpu/build_llamacpp_cuda.sh) is unpacked there.
# When its llama-bench was built elsewhere (CUDA 13 and cuBLAS from the nvidia-cublas wheel,
# linked against a stub libcuda) and this machine has no system cuBLAS, put the cuBLAS of the
# machine's torch wheels (site-packages/nvidia/*/lib) on LD_LIBRARY_PATH. Prints what llama-bench
# still cannot resolve, if anything.
if [ ! -x "$1/bin/llama-bench" ] && [ -f .bench/llama-cuda.tar.xz ] && command -v nvidia-smi > /dev/null; then
  mkdir -p "$1" && tar -C "$1" -xJf .bench/llama-cuda.tar.xz
fi
if [ -x "$1/bin/llama-bench" ]; then
  export LD_LIBRARY_PATH="$1/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ldd "$1/bin/llama-bench" | grep -q "not found"; then
    wheel_libs=$(python3 -c "import glob, os, site
dirs = {os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s + '/nvidia/**/libcublas*.so*', recursive=True)}
print(':'.join(sorted(dirs)))")
    [ -n "$wheel_libs" ] && export LD_LIBRARY_PATH="$wheel_libs:$LD_LIBRARY_PATH"
    ldd "$1/bin/llama-bench" | grep "not found"
  fi
fi
return 0 2>/dev/null || true
