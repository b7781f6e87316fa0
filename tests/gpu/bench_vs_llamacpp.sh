#!/usr/bin/env bash
# One call on the GPU machine: decode speed of llama.cpp and FreeToken on the same synthetic
# Qwen3-30B-A3B-shaped Q4_K_M GGUF (`freetoken bench make-model`: random weights, ids-only
# vocabulary that both load).
#
#   1. install the carried wheels (.whl: gguf, fastapi, ...) and freetoken-core (editable, no build)
#   2. in the background: build llama-bench (CUDA, sm_90) from the carried .bench/llama.cpp
#   3. meanwhile: write the GGUF into $MODEL_DIR (default /tmp/ft-bench; kept and reused while
#      the machine stays warm), then build freetoken-cpu-moe and freetoken-cuda
#   4. llama-bench: all routed experts on the CPU (-ot exps=CPU), the experts of the first
#      $NCMOE layers on the CPU (-ncmoe), everything on the GPU; -t $THREADS -p 512 -n 64 -r 2
#   5. run_freetoken_bench (below): the FreeToken side
#
# Every stage runs under `timeout`, cut to what is left of $BUDGET_S seconds (default 530).
# Logs go to $OUT (at most 8 files: summary.txt, system.txt, setup.log, llamacpp-build.log,
# make-model.log, llama-bench.log, llama-bench.md, freetoken-bench.log); what is printed is
# also summary.txt.
#
# Usage (repository root; .bench/llama.cpp and .whl carried):
#   bash tests/gpu/bench_vs_llamacpp.sh [--layers N] [--preset NAME] [--cpu-only] [--no-freetoken-build]
# --layers N: cut the model to its first N layers when time is short (48 = full, ~17.3 GiB).
# --cpu-only: build llama.cpp without CUDA (a smoke test of this script on a machine without a GPU).
# Environment: OUT, MODEL_DIR, THREADS (16), NCMOE (24), BUDGET_S (530), REPS (llama-bench -r, 2),
# LONG (a prompt length, e.g. 16384: llama-bench -ncmoe runs pp$LONG and tg64 at depth $LONG instead of
# pp512/tg64, and FreeToken's runs take a $LONG-token prompt with --max-model-len $LONG + 512),
# LLAMA_FIT_MIB (a card size in MiB, e.g. 24576: NCMOE becomes the smallest -ncmoe whose llama-bench
# process peaks within it, its own GPU memory sampled with nvidia-smi over a run of the same prompt/depth),
# LLAMA_HOST_EXPERTS, LLAMA_ALL_GPU (1; 0 skips llama-bench's all-experts-on-the-CPU or all-on-the-GPU run),
# LLAMA_AFTER (0; 1 runs llama-bench -ncmoe again after FreeToken's runs),
# FT_TESTS (GPU test files run while llama.cpp compiles; FT_TESTS_TIMEOUT 180), FT_PLACEMENTS (FreeToken's
# --moe-cpu-layers values, or limit:SIZE; SPEC@FLAG,VALUE,... adds flags; default "all $NCMOE 0"), FT_BATCHES ("1 8"), LLAMACPP_SRC
# (.bench/llama.cpp), LLAMACPP_BUILD (/tmp/llamacpp-build: an existing llama-bench there is
# reused, e.g. a carried build: tests/gpu/llamacpp_libs.sh), SKIP_SETUP=1 (install and build nothing of ours: python3 already has it all).
set -uo pipefail

LAYERS=48
PRESET=qwen3-30b-a3b
CPU_ONLY=0
FT_BUILD=1
while [ $# -gt 0 ]; do
  case $1 in
    --layers) LAYERS=$2; shift 2 ;;
    --preset) PRESET=$2; shift 2 ;;
    --cpu-only) CPU_ONLY=1; shift ;;
    --no-freetoken-build) FT_BUILD=0; shift ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-/tmp/ft-out}
MODEL_DIR=${MODEL_DIR:-/tmp/ft-bench}
THREADS=${THREADS:-16}
NCMOE=${NCMOE:-24}
BUDGET_S=${BUDGET_S:-530}
SRC=${LLAMACPP_SRC:-.bench/llama.cpp}
B=${LLAMACPP_BUILD:-/tmp/llamacpp-build}
MODEL=$MODEL_DIR/$PRESET-q4_k_m-L$LAYERS.gguf
mkdir -p "$OUT" "$MODEL_DIR"
source tests/gpu/llamacpp_libs.sh "$B"  # a carried build: its libraries, and cuBLAS from the torch wheels
SUM=$OUT/summary.txt
: > "$SUM"
export PYTHONUNBUFFERED=1 FREETOKEN_CUDA_ARCH=${FREETOKEN_CUDA_ARCH:-90}
export B SRC CPU_ONLY OUT MODEL THREADS NCMOE LONG
unset TRITON_INTERPRET  # compiled Triton kernels on the GPU
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(elapsed) s] $*" | tee -a "$SUM"; }
# left LIMIT: LIMIT seconds, or what is left of the budget if less (at least 1)
left() { local l=$(( BUDGET_S - $(elapsed) )); [ "$l" -lt "$1" ] || l=$1; [ "$l" -ge 1 ] || l=1; echo "$l"; }

# ---------------------------------------------------------------- system
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  echo "cores: $(nproc)"; grep -m1 'model name' /proc/cpuinfo
  grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|amx_int8|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  free -g; df -h /tmp "$MODEL_DIR" | sort -u
  python3 -c "import sys, numpy, torch; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__)" 2>&1
  cmake --version | head -1; nvcc --version 2>&1 | tail -1; command -v ninja || echo "no ninja"
} > "$OUT/system.txt" 2>&1
say "$(head -2 "$OUT/system.txt" | tail -1) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) | $(nproc) cores"

# ---------------------------------------------------------------- 1. wheels + freetoken-core
SETUP=$OUT/setup.log
if [ "${SKIP_SETUP:-0}" = 1 ]; then
  say "SKIP_SETUP=1: using the python3 environment as it is"
elif [ -d .whl ]; then
  # --no-index: only the carried wheels; what the machine has and satisfies the requirements stays
  timeout "$(left 120)" python3 -m pip install --no-index --find-links .whl gguf fastapi uvicorn pydantic openai >> "$SETUP" 2>&1
  say "wheels rc=$?"
else
  say "no .whl folder: carry .whl (tests/gpu/wheels.txt says how to make it); gguf may be missing"
fi
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  timeout "$(left 120)" python3 -m pip install --no-deps --no-build-isolation -e ./freetoken-core >> "$SETUP" 2>&1
  say "freetoken-core install rc=$?"
fi

# ---------------------------------------------------------------- 2. llama-bench build (background)
build_llamacpp() {
  if [ -x "$B/bin/llama-bench" ]; then echo "reusing $B/bin/llama-bench"; return 0; fi
  [ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp source in $SRC: carry .bench/llama.cpp"; return 1; }
  local gen=() cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90) noamx=""
  command -v ninja > /dev/null && gen=(-G Ninja)
  [ "$CPU_ONLY" = 1 ] && cuda=(-DGGML_CUDA=OFF)
  # ggml's AMX matmul (built when -march=native finds AMX) segfaulted in ggml_backend_amx_mul_mat
  # on a Xeon with AMX under the same kind of VM, with make-model files of the tiny and the real
  # shapes: leave AMX out; the AVX-512 paths and the CPU repack stay on.
  grep -q -w amx_int8 /proc/cpuinfo && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  echo "configure: ${gen[*]} ${cuda[*]} C/CXX flags: '${noamx}'"
  cmake -B "$B" -S "$SRC" "${gen[@]}" "${cuda[@]}" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx" \
    && cmake --build "$B" -j "$(nproc)" --target llama-bench
}
( timeout "$(left 420)" bash -c "$(declare -f build_llamacpp); build_llamacpp" \
    > "$OUT/llamacpp-build.log" 2>&1; echo "rc=$?" >> "$OUT/llamacpp-build.log" ) &
BUILD_PID=$!
say "llama-bench build started (pid $BUILD_PID, log llamacpp-build.log)"

# ---------------------------------------------------------------- 3. the model file
MM=$OUT/make-model.log
if [ -f "$MODEL.ok" ]; then
  say "reusing $MODEL ($(du -h "$MODEL" | cut -f1))"
else
  rm -f "$MODEL"
  t=$(date +%s)
  timeout "$(left 300)" python3 -m freetoken.cli.main bench make-model --preset "$PRESET" --layers "$LAYERS" --threads "$(nproc)" \
    --out "$MODEL" > "$MM" 2>&1
  rc=$?; dt=$(( $(date +%s) - t ))
  if [ $rc = 0 ]; then
    touch "$MODEL.ok"
    say "make-model: $(tail -1 "$MM") ($(python3 -c "import os; print(f'{os.path.getsize(\"$MODEL\") / 1e9 / max($dt, 1):.2f}')") GB/s wall)"
  else
    say "make-model FAILED rc=$rc after ${dt}s:"; tail -5 "$MM" | tee -a "$SUM"
  fi
fi

if [ "$FT_BUILD" = 1 ] && [ "$CPU_ONLY" = 0 ] && [ "${SKIP_SETUP:-0}" != 1 ]; then
  # before llama-bench runs, so that no compiler competes with its CPU threads
  t=$(date +%s)
  timeout "$(left 240)" python3 -m pip install --no-deps --no-build-isolation -e ./freetoken-cpu-moe -e ./freetoken-cuda \
    >> "$SETUP" 2>&1
  say "freetoken-cpu-moe + freetoken-cuda build rc=$? in $(( $(date +%s) - t ))s"
fi

if [ -n "${FT_TESTS:-}" ] && [ "$CPU_ONLY" = 0 ]; then
  # GPU test files while llama.cpp compiles (the GPU is idle then)
  t=$(date +%s)
  timeout "$(left "${FT_TESTS_TIMEOUT:-180}")" python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" \
    -o addopts="" $FT_TESTS > "$OUT/pytest.log" 2>&1
  rc=$?
  pkill -9 -f "python3 -m pytest" 2>/dev/null  # a stage cut by timeout leaves nothing spinning beside the benchmarks
  say "GPU tests rc=$rc in $(( $(date +%s) - t ))s: $(grep -E 'passed|failed' "$OUT/pytest.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -10 | tee -a "$SUM"
fi

wait "$BUILD_PID"
say "llama-bench build: $(tail -1 "$OUT/llamacpp-build.log")"
grep -E -i "error|CMAKE_CXX_FLAGS|AMX" "$OUT/llamacpp-build.log" | head -5 | tee -a "$SUM"

# ---------------------------------------------------------------- 4. llama-bench
LB=$OUT/llama-bench.log
MD=$OUT/llama-bench.md
TMPB=/tmp/llama-bench-run.txt  # scratch, outside $OUT
: > "$MD"
bench() {  # bench "TITLE" LIMIT_S ARGS... (-p/-n: $PN, default pp512 and tg64)
  local title=$1 limit=$2; shift 2
  if [ "$(left "$limit")" -lt 20 ]; then say "skip llama-bench ($title): out of time"; return; fi
  echo "# $title" | tee -a "$MD" >> "$LB"
  local t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$(left "$limit")" "$B/bin/llama-bench" -m "$MODEL" -t "$THREADS" ${PN:--p 512 -n 64} -r "${REPS:-2}" -o md "$@" \
    > "$TMPB" 2>&1
  local rc=$?
  cat "$TMPB" >> "$LB"
  grep -E '^\|' "$TMPB" >> "$MD"  # its table (the columns differ between configurations)
  rm -f "$TMPB"
  say "llama-bench ($title) rc=$rc in $(( $(date +%s) - t ))s"
}
process_peak_mib() {  # process_peak_mib ARGS...: llama-bench's peak GPU memory (MiB, nvidia-smi) over one run
  "$B/bin/llama-bench" -m "$MODEL" -t "$THREADS" -r 1 -o md "$@" > /tmp/llama-bench-fit.txt 2>&1 &
  local pid=$! peak=0 used
  while kill -0 "$pid" 2>/dev/null; do
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
      | awk -F', ' -v p="$pid" '$1 == p {print $2}')
    [ -n "$used" ] && [ "$used" -gt "$peak" ] && peak=$used
    sleep 0.2
  done
  wait "$pid" || peak=999999  # a run that failed (out of memory) does not fit
  echo "$peak"
}
fit_ncmoe() {  # the smallest -ncmoe (0..LAYERS) whose run peaks within LLAMA_FIT_MIB, by bisection
  local lo=0 hi=$LAYERS mid peak pn
  if [ -n "${LONG:-}" ]; then pn=(-p 0 -n 16 -d "$LONG"); else pn=(-p 512 -n 16); fi
  while [ "$lo" -lt "$hi" ]; do
    mid=$(( (lo + hi) / 2 ))
    peak=$(timeout "$(left 120)" bash -c "$(declare -f process_peak_mib); process_peak_mib -ngl 99 -ncmoe $mid ${pn[*]}")
    say "llama-bench -ncmoe $mid ${pn[*]}: process peak ${peak:-?} MiB (fit: ${LLAMA_FIT_MIB} MiB)"
    if [ -n "$peak" ] && [ "$peak" -le "$LLAMA_FIT_MIB" ]; then hi=$mid; else lo=$(( mid + 1 )); fi
  done
  echo "$lo"
}
if [ -x "$B/bin/llama-bench" ] && [ -f "$MODEL.ok" ] && [ -n "${LLAMA_FIT_MIB:-}" ] && [ "$CPU_ONLY" = 0 ]; then
  export B MODEL THREADS
  NCMOE=$(fit_ncmoe | tail -1); export NCMOE
  say "largest llama.cpp placement within $LLAMA_FIT_MIB MiB: -ngl 99 -ncmoe $NCMOE"
fi
if [ -x "$B/bin/llama-bench" ] && [ -f "$MODEL.ok" ]; then
  [ "${LLAMA_HOST_EXPERTS:-1}" = 1 ] && bench "all routed experts on the CPU, the rest on the GPU" 150 -ngl 99 -ot exps=CPU
  if [ -n "${LONG:-}" ]; then
    PN="-p $LONG -n 0" bench "experts of the first $NCMOE layers on the CPU, a $LONG-token prompt" 120 -ngl 99 -ncmoe "$NCMOE"
    PN="-p 0 -n 64 -d $LONG" bench "experts of the first $NCMOE layers on the CPU, decode at depth $LONG" 150 \
      -ngl 99 -ncmoe "$NCMOE"
  else
    bench "experts of the first $NCMOE layers on the CPU" 120 -ngl 99 -ncmoe "$NCMOE"
  fi
  [ "${LLAMA_ALL_GPU:-1}" = 1 ] && bench "everything on the GPU" 90 -ngl 99
  tee -a "$SUM" < "$MD"
else
  say "llama-bench not run: binary $( [ -x "$B/bin/llama-bench" ] && echo ok || echo missing ), model $( [ -f "$MODEL.ok" ] && echo ok || echo missing )"
fi

# ---------------------------------------------------------------- 5. FreeToken
# Fill with `freetoken bench decode ...` lines on "$MODEL" (exported, like OUT, THREADS and
# NCMOE), e.g. python3 -m freetoken.cli.main bench decode --model "$MODEL" --batch 1 8 ...
# Its output goes to freetoken-bench.log; lines starting with "SUMMARY " also into summary.txt.
run_freetoken_bench() {
  local spec args tag
  for spec in ${FT_PLACEMENTS:-all $NCMOE 0}; do
    local extra=""
    case $spec in *@*) extra=${spec#*@}; spec=${spec%%@*} ;; esac  # SPEC@FLAG,VALUE,...: more flags
    case $spec in  # limit:SIZE = the default placement under --gpu-memory-limit SIZE (a smaller card)
      limit:*) args=(--gpu-memory-limit "${spec#limit:}"); tag=${spec/:/-} ;;
      *) args=(--moe-cpu-layers "$spec"); tag=$spec ;;
    esac
    if [ -n "$extra" ]; then IFS=',' read -ra more <<< "$extra"; args+=("${more[@]}"); tag=$tag-$(echo "$extra" | tr -c 'a-zA-Z0-9\n' '_'); fi
    echo "# freetoken bench decode ${args[*]}"
    # (the placement's flags last: they override these defaults, e.g. --cpu-threads)
    python3 -m freetoken.cli.main bench decode --model "$MODEL" --backend cuda --stages \
      --cpu-threads "$((THREADS - 1))" --batch ${FT_BATCHES:-1 8} --prompt-len "${LONG:-512}" --gen-len 64 --repeats 1 \
      --max-model-len "$(( ${LONG:-512} + 512 ))" "${args[@]}" --json > "/tmp/ft-bench/decode-$tag.json" || continue
    python3 -c "import json; d=json.load(open('/tmp/ft-bench/decode-$tag.json'))
rep = d['backend_report']; plan = rep.get('memory_plan') or {}
print('SUMMARY freetoken $tag host read bandwidth %.1f GB/s before, %.1f after' % (d.get('bandwidth_GBs') or 0, d.get('bandwidth_GBs_after') or 0))
print('SUMMARY freetoken $tag cpu_spin_ms', rep.get('cpu_spin_ms'), 'coordinator', json.dumps(rep.get('coordinator')),
      'host_threads', json.dumps(rep.get('host_threads')))
for k in ('expert_cache', 'prefill_stream', 'moe_stats'):
    v = rep.get(k)
    if v: print('SUMMARY freetoken $tag', k, json.dumps({x: y for x, y in v.items() if x not in ('per_layer', 'pools')}))
for b, v in d['batches'].items():
    print('SUMMARY freetoken $tag batch', b, 'prompt %.1f tok/s decode %.1f tok/s' % (v['prompt_tok_s'], v['decode_tok_s']),
          'gpu_max_alloc %.2f GiB' % ((v.get('gpu_max_allocated_bytes') or 0) / 2**30), 'cpu_layers', rep.get('moe_cpu_layers'),
          'dense %.2f GiB' % ((plan.get('dense') or 0) / 2**30), 'embedding', plan.get('embedding'),
          'buffers %.3f GiB' % ((plan.get('scratch') or 0) / 2**30), 'kv %.3f GiB' % ((plan.get('kv_budget') or 0) / 2**30))
    print('SUMMARY freetoken $tag batch', b, 'decode runs', v.get('decode_tok_s_runs'), 'median step %.2f ms' % (v.get('decode_step_ms_median') or 0),
          'above median %.1f ms' % (v.get('decode_ms_above_median') or 0), 'slowest', v.get('decode_slowest_steps'),
          'other processes cpu', v.get('other_processes_cpu_runs'))
st = d.get('stages_b1_us')
if st: print('SUMMARY freetoken $tag stages_b1_us', json.dumps({k: round(v, 1) for k, v in st.items()}))"
  done
}
if [ "$(left 60)" -ge 20 ]; then
  t=$(date +%s)
  timeout "$(left 600)" bash -c "$(declare -f run_freetoken_bench); run_freetoken_bench" \
    > "$OUT/freetoken-bench.log" 2>&1
  rc=$?
  grep '^SUMMARY ' "$OUT/freetoken-bench.log" | tee -a "$SUM"
  say "run_freetoken_bench rc=$rc in $(( $(date +%s) - t ))s"
else
  say "run_freetoken_bench skipped: out of time"
fi
if [ "${LLAMA_AFTER:-0}" = 1 ] && [ -x "$B/bin/llama-bench" ] && [ -f "$MODEL.ok" ]; then
  # the same -ncmoe run again after FreeToken's: the host's speed drifts within a call, and a
  # reference on both sides of the runs brackets it
  : > "$MD"
  bench "experts of the first $NCMOE layers on the CPU, after FreeToken's runs" 60 -ngl 99 -ncmoe "$NCMOE"
  tee -a "$SUM" < "$MD"
fi
say "done (this output is also $OUT/summary.txt)"
