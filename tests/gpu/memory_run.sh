#!/usr/bin/env bash
# One call on the GPU machine: the out-of-memory recovery tests on the cuda backend, the GPU
# engine tests, then tests/gpu/memory_peaks.py on the 48-layer Qwen3-30B-A3B-shaped Q4_K_M file
# (made once under /tmp/ft-bench) at each limit in LIMITS (GiB) with the chunks in CHUNKS and
# the prompts in PROMPTS; then each tiny preset of TINY ("PRESET:LIMIT_GIB ...", context 4096,
# prompts 1024 and 4000) at its limit. With LLAMA_NCMOE="N ..." (and .bench/llama.cpp carried) llama-bench
# is built meanwhile and, at the end, runs tg16 at depth LLAMA_DEPTH (16384) with -ncmoe N on the same
# file while nvidia-smi samples the device's used memory: llama.cpp's whole-process peak at that depth.
# PRESET (qwen3-30b-a3b) and LAYERS (48) name another make-model preset and cut.
# BATCHES="1,8,32": each engine then also runs that many concurrent requests at a time (decode steps of that
# batch) and reports their peaks.
# Usage (repository root, .whl carried): bash tests/gpu/memory_run.sh
set -uo pipefail
LIMITS=${LIMITS:-"16"}; CHUNKS=${CHUNKS:-"256,2048,16384"}; PROMPTS=${PROMPTS:-"1024,8192,16384"}
CTX=${CTX:-32768}; LAYERS=${LAYERS:-48}; TESTS=${TESTS-"tests/gpu/test_gpu_out_of_memory.py"}
source tests/gpu/device_setup.sh || exit 1
B=${LLAMACPP_BUILD:-/tmp/llamacpp-build}
if [ -n "${LLAMA_NCMOE:-}" ] && [ ! -x "$B/bin/llama-bench" ]; then
  # the flags of tests/gpu/bench_vs_llamacpp.sh (ggml's AMX matmul left out: it crashed on this host)
  ( cmake -B "$B" -S .bench/llama.cpp -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" && cmake --build "$B" -j 8 --target llama-bench ) \
    > /tmp/llamacpp-build.log 2>&1 &
  BUILD_PID=$!
fi
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" $TESTS -o addopts="" \
    --timeout 200 > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
# the file name and its .ok mark are those of tests/gpu/bench_vs_llamacpp.sh: a later call on the warm machine reuses it
PRESET=${PRESET:-qwen3-30b-a3b}; M=/tmp/ft-bench/$PRESET-q4_k_m-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
if [ ! -f "$M.ok" ]; then
  timeout 200 python3 -m freetoken.cli.main bench make-model --preset "$PRESET" --layers "$LAYERS" \
    --quant q4_k_m --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1 && touch "$M.ok"
fi
stamp "make-model $( [ -f "$M.ok" ] && echo ok || echo FAILED) $(du -h "$M" | cut -f1)"
for limit in $LIMITS; do
  timeout ${PEAK_TIMEOUT:-240} python3 tests/gpu/memory_peaks.py "$M" "$limit" "$CTX" "$CHUNKS" "$PROMPTS" 15 "${BATCHES:-}" \
    > "$OUT/peaks-$limit.jsonl" 2> "$OUT/peaks-$limit.err"
  stamp "memory peaks at $limit GiB rc=$?"; cat "$OUT/peaks-$limit.jsonl"; grep -E "Error|error" "$OUT/peaks-$limit.err" | head -5
done
for spec in ${TINY:-}; do
  preset=${spec%%:*}; limit=${spec#*:}; T=/tmp/ft-bench/$preset.gguf
  [ -f "$T" ] || timeout 120 python3 -m freetoken.cli.main bench make-model --preset "$preset" --out "$T" \
    > "$OUT/make-model-tiny.log" 2>&1
  timeout 120 python3 tests/gpu/memory_peaks.py "$T" "$limit" 4096 4096 1024,4000 15 > "$OUT/tiny.tmp" 2> "$OUT/tiny.err"
  stamp "$preset at $limit GiB rc=$?"; sed "s/^/$preset /" "$OUT/tiny.tmp" | tee -a "$OUT/peaks-tiny.jsonl"
  grep -E "Error|error" "$OUT/tiny.err" | head -3
done
if [ -n "${LLAMA_NCMOE:-}" ]; then
  [ -n "${BUILD_PID:-}" ] && wait "$BUILD_PID"
  stamp "llama-bench build: $(tail -1 /tmp/llamacpp-build.log)"
  idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  for n in $LLAMA_NCMOE; do
    "$B/bin/llama-bench" -m "$M" -t 16 -ngl 99 -ncmoe "$n" -p 0 -n 16 -d "${LLAMA_DEPTH:-16384}" -r 1 -o md \
      > /tmp/llama-bench-mem.txt 2>&1 &
    pid=$!; peak=0
    while kill -0 "$pid" 2>/dev/null; do
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
      [ "$used" -gt "$peak" ] && peak=$used; sleep 0.2
    done
    stamp "llama-bench -ncmoe $n -d ${LLAMA_DEPTH:-16384}: device peak $peak MiB (idle $idle MiB)"
    grep -E "^\| qwen" /tmp/llama-bench-mem.txt || tail -3 /tmp/llama-bench-mem.txt
  done
fi
