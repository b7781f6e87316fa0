#!/usr/bin/env bash
# Many users at once through the HTTP servers: `freetoken serve` and llama.cpp's llama-server
# (built from the carried .bench/llama.cpp) on the same synthetic GGUF, each driven by
# `freetoken bench clients` (N concurrent streaming /v1/completions users, random-id prompts,
# greedy answers of a fixed length with end of sequence ignored).
#
#   1. unless CPU_ONLY=1 or SETUP=0: tests/gpu/device_setup.sh (wheels, native builds)
#   2. in the background: build llama-server ($B/bin/llama-server is reused when there)
#   3. the model file (freetoken bench make-model --vocab bpe: llama-server streams text, so the file
#      needs token texts), kept as $MODEL_DIR/$PRESET-q4_k_m-L$LAYERS-bpe.gguf with a .ok mark
#   4. for each configuration of CONFIGS: llama-server, then freetoken serve, each driven with
#      every N of CLIENTS; the server stopped before the next starts
#
# CONFIGS: hybrid (llama.cpp -ncmoe $NCMOE against FreeToken --gpu-memory-limit $LIMIT), gpu
# (everything on the GPU, both), cpu (both on the CPU: no GPU needed, CPU_ONLY=1 builds llama.cpp
# without CUDA). Each server gets $MAXN = the largest of CLIENTS slots (llama-server -np, with
# -c = slots x (PROMPT + GEN + 64), FreeToken --max-running-requests, --max-model-len PROMPT + GEN + 64 and
# --kv-cache-tokens as llama-server's -c: under a memory limit the plan otherwise keeps KV for one context).
# FT_VARIANTS: FreeToken servers to run per configuration, ';'-separated sets of extra `serve` flags
# (an empty set: the defaults), e.g. "; --prefill-chunk 256 --cuda-graph-max-bs 16"; each is
# freetoken-CONFIG-vI in the results. LLAMA (1; 0: no llama-server). WARM (1): every server first
# gets one untimed run (4 users, one request each) so kernels compiled at first use are not timed.
# Environment: OUT (/tmp/ft-out), MODEL_DIR (/tmp/ft-bench), PRESET (qwen3-30b-a3b), LAYERS (48),
# CLIENTS ("8 32"), REQUESTS (2), PROMPT (512), GEN (128), THREADS (16), NCMOE (7), LIMIT (16GiB),
# CONFIGS ("hybrid gpu"), CPU_ONLY (0), SETUP (1), LLAMACPP_SRC (.bench/llama.cpp), LLAMACPP_BUILD
# (/tmp/llamacpp-build), BUDGET_S (560: every stage is cut to what is left).
# Results: $OUT/summary.txt (also printed) and $OUT/clients-*.json, one per server.
set -uo pipefail
OUT=${OUT:-/tmp/ft-out}; MODEL_DIR=${MODEL_DIR:-/tmp/ft-bench}; PRESET=${PRESET:-qwen3-30b-a3b}; LAYERS=${LAYERS:-48}
CLIENTS=${CLIENTS:-"8 32"}; REQUESTS=${REQUESTS:-2}; PROMPT=${PROMPT:-512}; GEN=${GEN:-128}; THREADS=${THREADS:-16}
NCMOE=${NCMOE:-7}; LIMIT=${LIMIT:-16GiB}; CONFIGS=${CONFIGS:-"hybrid gpu"}; CPU_ONLY=${CPU_ONLY:-0}
SRC=${LLAMACPP_SRC:-.bench/llama.cpp}; B=${LLAMACPP_BUILD:-/tmp/llamacpp-build}; BUDGET_S=${BUDGET_S:-560}
MODEL=$MODEL_DIR/$PRESET-q4_k_m-L$LAYERS-bpe.gguf
MAXN=0; for n in $CLIENTS; do [ "$n" -gt "$MAXN" ] && MAXN=$n; done
CTX=$((PROMPT + GEN + 64))
mkdir -p "$OUT" "$MODEL_DIR"; SUM=$OUT/summary.txt; : > "$SUM"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$SUM"; }
left() { local l=$(( BUDGET_S - $(date +%s) + T0 )); [ "$l" -lt "$1" ] || l=$1; [ "$l" -ge 1 ] || l=1; echo "$l"; }

if [ "$CPU_ONLY" != 1 ] && [ "${SETUP:-1}" = 1 ]; then
  source tests/gpu/device_setup.sh || exit 1
  say "setup done"
fi
export PYTHONUNBUFFERED=1
[ "$CPU_ONLY" = 1 ] || source tests/gpu/llamacpp_libs.sh "$B"  # a carried build: unpacked, its libraries found

build_server() {
  if [ -x "$B/bin/llama-server" ]; then echo "reusing $B/bin/llama-server"; return 0; fi
  local cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90) noamx=""
  [ "$CPU_ONLY" = 1 ] && cuda=(-DGGML_CUDA=OFF)
  # ggml's AMX matmul crashed on the GPU machine's Xeon (see tests/gpu/bench_vs_llamacpp.sh)
  grep -q -w amx_int8 /proc/cpuinfo && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -B "$B" -S "$SRC" -G Ninja "${cuda[@]}" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx" && cmake --build "$B" -j "$(nproc)" --target llama-server
}
( timeout "$(left 420)" bash -c "$(declare -f build_server); B=$B SRC=$SRC CPU_ONLY=$CPU_ONLY build_server" \
    > "$OUT/llamacpp-build.log" 2>&1; echo "rc=$?" >> "$OUT/llamacpp-build.log" ) &
BUILD_PID=$!

if [ ! -f "$MODEL.ok" ]; then
  rm -f "$MODEL"
  timeout "$(left 300)" python3 -m freetoken.cli.main bench make-model --preset "$PRESET" --layers "$LAYERS" \
    --vocab bpe --out "$MODEL" > "$OUT/make-model.log" 2>&1 && touch "$MODEL.ok"
fi
say "model $( [ -f "$MODEL.ok" ] && echo "ok: $(du -h "$MODEL" | cut -f1)" || echo "FAILED (make-model.log)")"
wait "$BUILD_PID"; say "llama-server build: $(tail -1 "$OUT/llamacpp-build.log")"

PORT=18300
wait_health() {  # wait_health URL PID LIMIT_S: 0 once GET URL/health answers 200
  local deadline=$(( $(date +%s) + $3 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    kill -0 "$2" 2>/dev/null || return 1
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && return 0
    sleep 1
  done
  return 1
}
drive() {  # drive NAME CMD...: start a server, drive it with every N of CLIENTS, stop it
  local name=$1; shift
  PORT=$((PORT + 1))
  local url=http://127.0.0.1:$PORT
  "$@" --host 127.0.0.1 --port "$PORT" > "$OUT/server-$name.log" 2>&1 &
  local pid=$!
  if wait_health "$url" "$pid" "$(left 240)"; then
    [ "${WARM:-1}" = 1 ] && timeout "$(left 120)" python3 -m freetoken.cli.main bench clients --url "$url" --clients 4 \
      --requests 1 --prompt-tokens "$PROMPT" --max-tokens 16 --vocab 32000 --json > /dev/null 2> "$OUT/warm-$name.err"
    # shellcheck disable=SC2086
    timeout "$(left 400)" python3 -m freetoken.cli.main bench clients --url "$url" --clients $CLIENTS \
      --requests "$REQUESTS" --prompt-tokens "$PROMPT" --max-tokens "$GEN" --vocab 32000 --json \
      > "$OUT/clients-$name.json" 2> "$OUT/clients-$name.err"
    say "$name: clients rc=$?"
    python3 -c "import json, sys
d = json.load(open(sys.argv[1]))
for r in d['runs']:
    print('   ', sys.argv[2], ' '.join(f'{k}={r[k]}' for k in ('clients', 'ok', 'failed', 'aggregate_tok_s', 'per_user_tok_s_p50',
          'ttft_ms_p50', 'ttft_ms_p99', 'itl_ms_p50', 'itl_ms_p99', 'errors')))" "$OUT/clients-$name.json" "$name" \
      | tee -a "$SUM"
  else
    say "$name: the server did not become healthy; its log's tail:"; tail -5 "$OUT/server-$name.log" | tee -a "$SUM"
  fi
  kill -INT "$pid" 2>/dev/null; sleep 2; kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}
for config in $CONFIGS; do
  case $config in
    hybrid) lflags=(-ngl 99 -ncmoe "$NCMOE"); fflags=(--backend cuda --gpu-memory-limit "$LIMIT") ;;
    gpu) lflags=(-ngl 99); fflags=(--backend cuda --moe-cpu-layers 0) ;;
    cpu) lflags=(-ngl 0); fflags=(--backend cpu --cpu-threads "$THREADS") ;;  # (the last --cpu-threads wins)
    *) say "unknown configuration $config"; continue ;;
  esac
  [ "${LLAMA:-1}" = 1 ] && [ -x "$B/bin/llama-server" ] && [ -f "$MODEL.ok" ] && \
    drive "llamacpp-$config" "$B/bin/llama-server" -m "$MODEL" -t "$THREADS" -np "$MAXN" -c $((MAXN * CTX)) "${lflags[@]}"
  IFS=';' read -ra variants <<< "${FT_VARIANTS:-}"; [ ${#variants[@]} -gt 0 ] || variants=("")
  for i in "${!variants[@]}"; do
    name=freetoken-$config; [ ${#variants[@]} -gt 1 ] && name=$name-v$i
    read -ra extra <<< "${variants[$i]}"
    [ -f "$MODEL.ok" ] && drive "$name" python3 -m freetoken.cli.main serve --model "$MODEL" \
      --cpu-threads "$((THREADS > 1 ? THREADS - 1 : 1))" --max-running-requests "$MAXN" --max-model-len "$CTX" \
      --kv-cache-tokens $((MAXN * CTX)) \
      "${fflags[@]}" "${extra[@]}"
  done
done
say "done (also $OUT/summary.txt)"
