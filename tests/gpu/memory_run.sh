#!/usr/bin/env bash
# One call on the GPU machine: the out-of-memory recovery tests on the cuda backend, the GPU
# engine tests, then tests/gpu/memory_peaks.py on the 48-layer Qwen3-30B-A3B-shaped Q4_K_M file
# (made once under /tmp/ft-bench) at each limit in LIMITS (GiB) with the chunks in CHUNKS and
# the prompts in PROMPTS; then each tiny preset of TINY ("PRESET:LIMIT_GIB ...", context 4096,
# prompts 1024 and 4000) at its limit. Usage (repository root, .whl carried): bash tests/gpu/memory_run.sh
set -uo pipefail
LIMITS=${LIMITS:-"16"}; CHUNKS=${CHUNKS:-"256,2048,16384"}; PROMPTS=${PROMPTS:-"1024,8192,16384"}
CTX=${CTX:-32768}; LAYERS=${LAYERS:-48}; TESTS=${TESTS-"tests/gpu/test_gpu_out_of_memory.py"}
source tests/gpu/device_setup.sh || exit 1
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" $TESTS -o addopts="" \
    --timeout 200 > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
# the file name and its .ok mark are those of tests/gpu/bench_vs_llamacpp.sh: a later call on the warm machine reuses it
M=/tmp/ft-bench/qwen3-30b-a3b-q4_k_m-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
if [ ! -f "$M.ok" ]; then
  timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
    --quant q4_k_m --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1 && touch "$M.ok"
fi
stamp "make-model $( [ -f "$M.ok" ] && echo ok || echo FAILED) $(du -h "$M" | cut -f1)"
for limit in $LIMITS; do
  timeout ${PEAK_TIMEOUT:-240} python3 tests/gpu/memory_peaks.py "$M" "$limit" "$CTX" "$CHUNKS" "$PROMPTS" 15 \
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
