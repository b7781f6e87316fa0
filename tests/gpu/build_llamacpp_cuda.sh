#!/usr/bin/env bash
# On the development VM (no GPU; nvcc 13 installed, PyPI reachable): build llama.cpp's llama-bench and
# llama-server for the GPU machine (CUDA, sm_90) and pack them as .bench/llama-cuda.tar.xz (~43 MB), to
# carry instead of building there in every call (a build there takes minutes of device time and shares
# the host's cores with the runs). On the GPU machine:
#   mkdir -p /tmp/llamacpp-build && tar -C /tmp/llamacpp-build -xJf .bench/llama-cuda.tar.xz
# then the scripts' default LLAMACPP_BUILD (/tmp/llamacpp-build) finds it, and tests/gpu/llamacpp_libs.sh
# puts its libraries and the torch wheels' cuBLAS on LD_LIBRARY_PATH.
#
# What the VM lacks is taken from elsewhere: cuBLAS (headers and libraries) from the nvidia-cublas wheel
# of CUDA 13, and libcuda from a stub with the driver functions ggml-cuda calls (soname libcuda.so.1, so
# the GPU machine's driver library is the one loaded). The CPU code is built for AVX-512 with VNNI and
# BF16 but without AMX (ggml's AMX path crashed on that Xeon): GGML_NATIVE off, since this VM's
# processor is not the GPU machine's. About 25 minutes on 2 cores.
# Usage (repository root): bash tests/gpu/build_llamacpp_cuda.sh [SRC]   (SRC: .bench/llama.cpp, from
# ../shared/bench/llamacpp-source.sh)
set -euo pipefail
SRC=${1:-.bench/llama.cpp}
B=.bench/llama-cuda
DEPS=${DEPS:-/tmp/llamacpp-cuda-deps}
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp source in $SRC" >&2; exit 2; }
mkdir -p "$DEPS/stub"
if [ ! -d "$DEPS/nvidia/cu13/include" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEPS" "nvidia-cublas>=13,<14"
  (cd "$DEPS" && unzip -q -o nvidia_cublas-*.whl)
fi
LIB=$DEPS/nvidia/cu13/lib INC=$DEPS/nvidia/cu13/include
ln -sf libcublas.so.13 "$LIB/libcublas.so"; ln -sf libcublasLt.so.13 "$LIB/libcublasLt.so"
# the driver API functions ggml-cuda calls (its virtual memory pool, device attributes, errors)
DRIVER_FUNCS="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate
  cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap"
for f in $DRIVER_FUNCS; do echo "int $f(void) { return 0; }"; done > "$DEPS/stub/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$DEPS/stub/libcuda.so" "$DEPS/stub/stub.c"
# the programs link against libggml-cuda.so, which names libcuda.so.1: the linker looks it up
# by that name (-rpath-link), so the stub answers to it too
ln -sf libcuda.so "$DEPS/stub/libcuda.so.1"
cmake -B "$B" -S "$SRC" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_LIBRARY_PATH="$LIB" -DCMAKE_INCLUDE_PATH="$INC" -DCUDA_cuda_driver_LIBRARY="$DEPS/stub/libcuda.so" \
  "-DCMAKE_CUDA_FLAGS=-I$INC" "-DCMAKE_CXX_FLAGS=-I$INC" "-DCMAKE_C_FLAGS=-I$INC" \
  "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$DEPS/stub" > /tmp/llamacpp-cuda-cfg.log
nice -n 10 cmake --build "$B" -j "$(nproc)" --target llama-bench llama-server
missing=$(nm -D --undefined-only "$B/bin/libggml-cuda.so" | awk '$2 ~ /^cu[A-Z]/ {sub(/@.*/, "", $2); print $2}' \
  | sort -u | grep -v -x -F -f <(tr ' ' '\n' <<< "$DRIVER_FUNCS" | sed '/^$/d') || true)
if [ -n "$missing" ]; then
  echo "ggml-cuda calls driver functions the stub lacks (add them to DRIVER_FUNCS): $missing" >&2; exit 1
fi
readelf -d "$B/bin/libggml-cuda.so" | grep -q 'NEEDED.*libcuda.so.1' || { echo "libggml-cuda.so does not name libcuda.so.1" >&2; exit 1; }
strip --strip-unneeded "$B"/bin/*.so* "$B/bin/llama-bench" "$B/bin/llama-server" 2>/dev/null || true
tar -C "$B" -cJf .bench/llama-cuda.tar.xz bin
ls -la .bench/llama-cuda.tar.xz
