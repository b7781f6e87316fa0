#!/usr/bin/env bash
# One call on the GPU machine's host, CPU only (about 8 minutes): the CPU backend against llama.cpp
# on each kernel tier, on 16 and 2 threads, the same file, the same call.
#   1. llama.cpp built CPU-only twice from the carried .bench/llama.cpp, in the background:
#      GGML_NATIVE (this host's AVX-512; ggml's AMX matmul left out as in cpu_speed_run.sh) and
#      AVX2 + FMA + F16C only (what an AVX2 desktop's GGML_NATIVE build runs)
#   2. freetoken-core and freetoken-cpu-moe built in place (no GPU backend: nothing here uses one)
#   3. a Qwen3-30B-A3B-shaped Q4_K_M file of $LAYERS layers
#   4. for each of $THREADS: `freetoken bench decode --backend cpu` (prompt 512 once; decode after a
#      16-token prompt) on the best tier and capped to each of $TIERS (FREETOKEN_CPU_MOE_ISA), and
#      llama-bench -p 512 -n 64 with each build
# Usage (repository root, .bench/llama.cpp and .whl carried): bash tests/gpu/cpu_tiers_run.sh
# Environment: LAYERS (8), TIERS ("avx2"), THREADS ("16 2"), GEN (64).
set -uo pipefail
LAYERS=${LAYERS:-8}; TIERS=${TIERS:-avx2}; THREADS=${THREADS:-16 2}; GEN=${GEN:-64}
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
SRC=.bench/llama.cpp
CM=(-DGGML_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
noamx=""; grep -q -w amx_int8 /proc/cpuinfo && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
( cmake -B /tmp/llama-native -S $SRC "${CM[@]}" -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx" \
    && cmake --build /tmp/llama-native -j 8 --target llama-bench ) > "$OUT/llama-native-build.log" 2>&1 &
P1=$!
( cmake -B /tmp/llama-avx2 -S $SRC "${CM[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF && cmake --build /tmp/llama-avx2 -j 8 --target llama-bench ) \
    > "$OUT/llama-avx2-build.log" 2>&1 &
P2=$!
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (tests/gpu/wheels.txt): gguf for make-model
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/build.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e ./freetoken-core -e ./freetoken-cpu-moe >> "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
stamp "freetoken build done"
FT="python3 -m freetoken.cli.main"
python3 -c "
import freetoken_cpu_moe as cm
from freetoken.cpu_isa import detect_cpu
i = detect_cpu(); print('cpu:', i.model, '|', i.logical_cores, 'logical CPUs |', ' '.join(i.flags)); print('tiers:', cm.isa_tiers())"
M=/tmp/ft-bench/q4km-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
timeout 120 $FT bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" --quant q4_k_m --threads 8 --out "$M" \
  > "$OUT/make-model.log" 2>&1
stamp "make-model rc=$? $(du -h "$M" 2>/dev/null | cut -f1)"
wait $P1; stamp "llama.cpp native build rc=$?"; wait $P2; stamp "llama.cpp avx2 build rc=$?"
ft() {  # THREADS TIER(or best) -> one line
  local t=$1 tier=$2 env=() pool=$1
  [ "$tier" != best ] && env=(FREETOKEN_CPU_MOE_ISA=$tier)
  [ "$t" -gt 8 ] && pool=$((t - 1))  # the 16th core is left to the calling thread's neighbours
  local p d
  p=$(env "${env[@]}" timeout 100 $FT bench decode --model "$M" --backend cpu --cpu-threads $pool --batch 1 --prompt-len 512 \
      --tokens 2 --repeats 2 --json 2>>"$OUT/ft.err" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["prompt_tok_s"]["1"], 1))')
  d=$(env "${env[@]}" timeout 100 $FT bench decode --model "$M" --backend cpu --cpu-threads $pool --batch 1 --prompt-len 16 \
      --tokens $((GEN + 1)) --repeats 3 --json 2>>"$OUT/ft.err" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["decode_tok_s"]["1"], 1), "tok/s, read", round(d["bandwidth_GBs"], 1), "GB/s")')
  stamp "freetoken $tier, $pool pool threads: prompt512 ${p:-?} tok/s, decode ${d:-?}"
}
ll() {  # THREADS BUILD
  timeout 120 /tmp/llama-$2/bin/llama-bench -m "$M" -t "$1" -p 512 -n "$GEN" -r 2 -o md > "$OUT/llama-$2-t$1.md" 2>&1
  stamp "llama.cpp $2 -t $1:"; grep -E '^\| [a-z]' "$OUT/llama-$2-t$1.md" | grep -v '^| model' | awk -F'|' '{print "   ", $(NF-2), $(NF-1)}'
}
for T in $THREADS; do
  ll $T native; ft $T best
  ll $T avx2
  for tier in $TIERS; do ft $T "$tier"; done
done
stamp "all done"
