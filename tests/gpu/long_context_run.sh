#!/usr/bin/env bash
# One call on the GPU machine: long contexts on the 48-layer Qwen3-30B-A3B-shaped Q4_K_M file.
#   1. tests/gpu/device_setup.sh, the model file (shared with memory_run.sh and bench_vs_llamacpp.sh),
#      llama-bench built in the background (niced; the GPU-side figures below barely use the CPU) unless
#      LLAMACPP_BUILD names a carried build (tests/gpu/llamacpp_libs.sh)
#   2. tests/gpu/bench_decode_attention.py $ATTN_ARGS (e.g. --sweep-partitions): the paged split-K decode
#      attention against its ceiling
#   3. `freetoken bench decode` with a prompt of each length of LENS, everything on the GPU, and (after
#      the build, which would share the host's cores) under --gpu-memory-limit $LIMIT (LIMIT_LENS: the
#      lengths of that placement)
#   4. llama-bench on the same file: everything on the GPU, pp N and tg64 at depth N for each N of LENS;
#      -ncmoe N for each N of NCMOE at depth LIMIT_DEPTH, nvidia-smi sampling the device's peak.
# TESTS: GPU test files run beside make-model. BATCH: the decode batch of the FreeToken runs (1; a batch
# of B reads B contexts of each length). AB_TILES: a `--tiles` value (e.g. attention:block_n=64,num_stages=2)
# each all-GPU run is repeated with, same file, same process order. LLAMA=0: no llama-bench runs;
# ATTN=0: no attention benchmark. NCMOE_PROMPT=1: each -ncmoe N also runs a prompt of LIMIT_DEPTH tokens.
# LIMIT_LENS="" or NCMOE="": none of those runs.
# Usage (repository root, .whl and .bench carried):
#   bash tests/gpu/long_context_run.sh
set -uo pipefail
LENS=${LENS:-"16384 32704"}; LIMIT=${LIMIT:-16GiB}; LIMIT_LENS=${LIMIT_LENS-32704}
NCMOE=${NCMOE-"16 17"}; LIMIT_DEPTH=${LIMIT_DEPTH:-32704}; LAYERS=48
source tests/gpu/device_setup.sh || exit 1
B=${LLAMACPP_BUILD:-/tmp/llamacpp-build}
source tests/gpu/llamacpp_libs.sh "$B"
M=/tmp/ft-bench/qwen3-30b-a3b-q4_k_m-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
if [ ! -x "$B/bin/llama-bench" ]; then
  ( nice -n 19 cmake -B "$B" -S .bench/llama.cpp -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      && nice -n 19 cmake --build "$B" -j 14 --target llama-bench ) > /tmp/llamacpp-build.log 2>&1 &
  BUILD_PID=$!
fi
if [ -n "${TESTS:-}" ]; then  # GPU tests beside make-model (CPU), done before the GPU timings
  ( timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" $TESTS > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest.txt" ) &
  TESTS_PID=$!
fi
if [ ! -f "$M.ok" ]; then
  timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
    --quant q4_k_m --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1 && touch "$M.ok"
fi
stamp "make-model $( [ -f "$M.ok" ] && echo ok || echo FAILED)"
[ -n "${TESTS_PID:-}" ] && { wait "$TESTS_PID"; stamp "GPU tests: $(grep -E 'passed|failed' "$OUT/pytest.txt" | tail -1)"; }
if [ "${ATTN:-1}" != 0 ]; then
  timeout 240 python3 tests/gpu/bench_decode_attention.py ${ATTN_ARGS:-} > "$OUT/attention.txt" 2>&1
  stamp "bench_decode_attention rc=$?"; cat "$OUT/attention.txt"
fi
ft() {  # ft TAG PROMPT_LEN FLAGS...
  local tag=$1 n=$2; shift 2
  timeout 150 python3 -m freetoken.cli.main bench decode --model "$M" --backend cuda --cpu-threads 15 --batch "${BATCH:-1}" \
    --prompt-len "$n" --gen-len 64 --repeats 1 --max-model-len $((n + 512)) "$@" --json > "$OUT/decode-$tag-$n.json" \
    2> "/tmp/decode-$tag-$n.err"
  local rc=$?
  python3 -c "import json, sys
d = json.load(open(sys.argv[1])); v = d['batches'][sys.argv[4]]; p = d['backend_report'].get('memory_plan') or {}
print('freetoken', sys.argv[2], 'prompt', sys.argv[3], 'prompt %.1f tok/s decode %.1f tok/s' % (v['prompt_tok_s'], v['decode_tok_s']),
      'median step %.2f ms' % (v.get('decode_step_ms_median') or 0), 'torch peak %.2f GiB' % ((v.get('gpu_max_allocated_bytes') or 0) / 2**30),
      'cpu layers', d['backend_report'].get('moe_cpu_layers'), 'chunk', p.get('prefill_chunk'))" \
    "$OUT/decode-$tag-$n.json" "$tag" "$n" "${BATCH:-1}" || { stamp "$tag $n rc=$rc"; tail -3 "/tmp/decode-$tag-$n.err"; }
}
for n in $LENS; do
  ft all-gpu "$n" --moe-cpu-layers 0
  [ -n "${AB_TILES:-}" ] && ft all-gpu-tiles "$n" --moe-cpu-layers 0 --tiles "$AB_TILES"
done
[ -n "${BUILD_PID:-}" ] && wait "$BUILD_PID"  # the hybrid runs use the host's cores: not beside the build
stamp "llama-bench build: $(tail -1 /tmp/llamacpp-build.log 2>/dev/null || echo "reused $B")"
for n in $LIMIT_LENS; do ft "limit-$LIMIT" "$n" --gpu-memory-limit "$LIMIT"; done
stamp "freetoken runs done"
lb() {  # lb ARGS...: one llama-bench run, its device peak sampled
  "$B/bin/llama-bench" -m "$M" -t 16 -o md "$@" > /tmp/llama-bench.txt 2>&1 &
  local pid=$! peak=0 used
  while kill -0 "$pid" 2>/dev/null; do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "$used" -gt "$peak" ] && peak=$used; sleep 0.2
  done
  stamp "llama-bench $*: device peak $peak MiB"
  grep -E "^\| qwen" /tmp/llama-bench.txt || tail -3 /tmp/llama-bench.txt
}
[ "${LLAMA:-1}" = 0 ] && { stamp "done (no llama-bench runs)"; exit 0; }
for n in $LENS; do
  lb -ngl 99 -p "$n" -n 0 -r 1
  lb -ngl 99 -p 0 -n 64 -d "$n" -r 2
done
for n in $NCMOE; do
  lb -ngl 99 -ncmoe "$n" -p 0 -n 64 -d "$LIMIT_DEPTH" -r 1
  [ "${NCMOE_PROMPT:-0}" = 1 ] && lb -ngl 99 -ncmoe "$n" -p "$LIMIT_DEPTH" -n 0 -r 1
done
stamp "done"
