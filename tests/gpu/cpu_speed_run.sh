#!/usr/bin/env bash
# One call on the GPU machine's host (CPU only; about 7 minutes): how the CPU kernels and the
# whole-model CPU backend scale on its 16 cores.
#   1. build freetoken-core, freetoken-cpu-moe (and freetoken-cuda) in place (device_setup.sh)
#   2. the ISA tiers this CPU offers (amx needs amx_tile/int8/bf16, avx512_bf16 and the kernel's
#      permission, which freetoken_cpu_moe requests)
#   3. `freetoken bench cpu-moe` for every expert format at T=1 (decode, % of the read bandwidth
#      measured in the same run) and T=$PREFILL_T (prompt: the amx tier's tiles), then T=$PREFILL_T
#      again on the avx512 tier for Q4_K and BF16 (what the matrix unit adds)
#   4. a Qwen3-30B-A3B-shaped Q4_K_M file of $LAYERS layers, `freetoken bench decode --backend cpu
#      --cpu-profile` (prompt $PROMPT tokens, batch 1): prompt and decode tok/s and the per-part split
#      of a prefill and a decode step; then the prompt once more with torch on $THREADS threads for
#      prompt steps (FREETOKEN_CPU_TORCH_THREADS) and torch's attention for prompt steps
#      (FREETOKEN_CPU_ATTENTION=decode: the pool's attention kernel against torch SDPA on $THREADS
#      threads), and on 2 pool threads (the 2-thread target)
#   5. the same-run reference: llama.cpp built CPU-only from the carried .bench/llama.cpp (built in
#      the background at the start, before anything is measured), llama-bench -t 16 and -t 2 on the
#      same file
# Every stage runs under its own timeout; logs in $OUT; what is printed is a compact summary.
# Usage (repository root): bash tests/gpu/cpu_speed_run.sh
# Environment: THREADS (15 pool threads; the 16th core is left to the calling thread's neighbours),
# PREFILL_T (512), LAYERS (8), PROMPT (512), GEN (32).
set -uo pipefail
THREADS=${THREADS:-15}; PREFILL_T=${PREFILL_T:-512}; LAYERS=${LAYERS:-8}; PROMPT=${PROMPT:-512}; GEN=${GEN:-32}
LLAMA_SRC=${LLAMACPP_SRC:-.bench/llama.cpp}; LLAMA_B=/tmp/llama-cpu
if [ -f "$LLAMA_SRC/CMakeLists.txt" ] && [ ! -x $LLAMA_B/bin/llama-bench ]; then
  # CPU-only (no op offload to a GPU); ggml's AMX matmul is left out as in bench_vs_llamacpp.sh
  noamx=""; grep -q -w amx_int8 /proc/cpuinfo && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  ( cmake -B $LLAMA_B -S "$LLAMA_SRC" -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx" && cmake --build $LLAMA_B -j 16 --target llama-bench ) \
    > /tmp/llama-cpu-build.log 2>&1 &
  LLAMA_PID=$!
fi
source tests/gpu/device_setup.sh || exit 1
[ -n "${LLAMA_PID:-}" ] && { wait "$LLAMA_PID"; stamp "llama.cpp CPU build rc=$?"; cp /tmp/llama-cpu-build.log "$OUT/"; }
FT="python3 -m freetoken.cli.main"
python3 - <<'EOF' 2>&1 | tee "$OUT/isa.txt"
import freetoken_cpu_moe as cm
from freetoken.cpu_isa import detect_cpu
info = detect_cpu()
print("cpu:", info.model, "|", info.logical_cores, "logical CPUs |", " ".join(info.flags))
print("tiers:", cm.isa_tiers(), "active:", cm.active_isa(), "| physical cores:", len(cm.physical_core_cpus()))
EOF
summary() {  # the result rows of a bench cpu-moe log
  grep -E "^(f32|f16|bf16|fp8_e4m3_b128|q8_0|q4_k|q5_k|q6_k) " "$1" | awk '{printf "  %-14s T=%-4s %10s us/layer %7s GB/s %5s of ceiling\n", $1, $2, $3, $5, $7}'
}
timeout 100 $FT bench cpu-moe --formats q4_k q5_k q6_k q8_0 fp8_e4m3_b128 bf16 --tokens 1 "$PREFILL_T" \
  --threads "$THREADS" --seconds 0.5 --layers 2 > "$OUT/cpu-moe.txt" 2>&1
stamp "bench cpu-moe (best tier) rc=$?"; summary "$OUT/cpu-moe.txt"
timeout 45 $FT bench cpu-moe --formats q4_k bf16 --tokens "$PREFILL_T" --threads "$THREADS" --seconds 0.5 --layers 2 \
  --isa avx512 > "$OUT/cpu-moe-avx512.txt" 2>&1
stamp "bench cpu-moe avx512 T=$PREFILL_T rc=$?"; summary "$OUT/cpu-moe-avx512.txt"
M=/tmp/ft-bench/q4km-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
[ -f "$M" ] || timeout 100 $FT bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" --quant q4_k_m --threads 16 \
  --out "$M" > "$OUT/make-model.log" 2>&1
stamp "make-model rc=$? $(du -h "$M" 2>/dev/null | cut -f1)"
DEC="$FT bench decode --model $M --backend cpu --cpu-threads $THREADS --batch 1 --prompt-len $PROMPT --gen-len $GEN --repeats 1 --bandwidth-bytes 512MiB"
timeout 90 $DEC --cpu-profile > "$OUT/decode-profile.txt" 2> "$OUT/decode-profile.err"
stamp "bench decode --cpu-profile rc=$?"
grep -E "^read bandwidth|^ +1 " "$OUT/decode-profile.txt" | cut -c1-150
sed -n '/^cpu profile/,$p' "$OUT/decode-profile.txt"
FREETOKEN_CPU_TORCH_THREADS=$THREADS timeout 60 $DEC --gen-len 4 > "$OUT/decode-torch-threads.txt" 2>&1
stamp "bench decode, torch on $THREADS threads for prompt steps rc=$?"
grep -E "^ +1 " "$OUT/decode-torch-threads.txt" | cut -c1-100
FREETOKEN_CPU_ATTENTION=decode FREETOKEN_CPU_TORCH_THREADS=$THREADS timeout 60 $DEC --gen-len 4 \
  > "$OUT/decode-torch-attention.txt" 2>&1
stamp "bench decode, torch attention on $THREADS threads for prompt steps rc=$?"
grep -E "^ +1 " "$OUT/decode-torch-attention.txt" | cut -c1-100
DEC2="$FT bench decode --model $M --backend cpu --cpu-threads 2 --batch 1 --prompt-len $PROMPT --gen-len $GEN --repeats 2"
timeout 150 $DEC2 > "$OUT/decode-2threads.txt" 2>&1
stamp "bench decode, 2 pool threads rc=$?"
grep -E "^ +1 " "$OUT/decode-2threads.txt" | cut -c1-100
if [ -x $LLAMA_B/bin/llama-bench ]; then
  timeout 150 $LLAMA_B/bin/llama-bench -m "$M" -t 16 -p "$PROMPT" -n "$GEN" -r 2 -o md > "$OUT/llama-cpu.md" 2>&1
  stamp "llama-bench CPU-only -t 16 rc=$?"; grep -E '^\| [a-z]' "$OUT/llama-cpu.md" | grep -v '^| model'
  timeout 150 $LLAMA_B/bin/llama-bench -m "$M" -t 2 -p "$PROMPT" -n "$GEN" -r 2 -o md > "$OUT/llama-cpu-t2.md" 2>&1
  stamp "llama-bench CPU-only -t 2 rc=$?"; grep -E '^\| [a-z]' "$OUT/llama-cpu-t2.md" | grep -v '^| model'
else
  stamp "no llama.cpp reference (carry .bench/llama.cpp)"
fi
stamp "all done"
