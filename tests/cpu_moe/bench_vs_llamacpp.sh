#!/usr/bin/env bash
# CPU-only speed against llama.cpp on this machine, in alternating rounds on the same GGUF file:
# llama-bench (-p 512 -n 64, one build per ISA label) and `freetoken bench decode --backend cpu`
# (decode after a 16-token prompt, as llama-bench's tg64 starts from an empty context; the
# prompt speed of a 512-token prompt) with the kernel tier capped by FREETOKEN_CPU_MOE_ISA.
# Each side starts only when other processes leave the CPU quiet (< QUIET% busy over 3 s).
# Usage (repository root):
#   bash tests/cpu_moe/bench_vs_llamacpp.sh MODEL.gguf "LABEL=LLAMA_BENCH_BINARY ..." "TIER ..."
# e.g.  bash tests/cpu_moe/bench_vs_llamacpp.sh q3-8l.gguf "avx2=/tmp/llama-avx2/bin/llama-bench" "avx2 avx_vnni"
# Environment: ROUNDS (3), THREADS (2), QUIET (10), FT (.venv/bin/freetoken).
# Prints one line per measurement: round, engine, tier, prompt tok/s, decode tok/s, read GB/s.
set -uo pipefail
MODEL=$1; LLAMAS=$2; TIERS=$3
ROUNDS=${ROUNDS:-3}; THREADS=${THREADS:-2}; QUIET=${QUIET:-10}; FT=${FT:-.venv/bin/freetoken}

busy() {  # percent of the CPU busy over 3 s
  read -r _ a b c d e f g _ < /proc/stat; local t1=$((a+b+c+d+e+f+g)) i1=$d
  sleep 3
  read -r _ a b c d e f g _ < /proc/stat; local t2=$((a+b+c+d+e+f+g)) i2=$d
  echo $(( 100 * ((t2-t1) - (i2-i1)) / (t2-t1) ))
}
wait_quiet() { local n=0; while [ "$(busy)" -ge "$QUIET" ] && [ $n -lt 60 ]; do n=$((n+1)); done; }

# llama-bench's CSV -> "prompt decode"; bench decode's JSON -> "prompt" or "decode GB/s"
read -r -d '' LLAMA_CSV <<'PY'
import csv, sys
rows = list(csv.DictReader(sys.stdin))
pp = [float(r["avg_ts"]) for r in rows if r["n_prompt"] == "512"]
tg = [float(r["avg_ts"]) for r in rows if r["n_gen"] == "64"]
print(f"{pp[0]:.1f} {tg[0]:.1f}" if pp and tg else "- -")
PY
read -r -d '' FT_JSON <<'PY'
import json, sys
d = json.load(sys.stdin)
if sys.argv[1] == "prompt":
    print(f"{d['prompt_tok_s']['1']:.1f}")
else:
    print(f"{d['decode_tok_s']['1']:.1f} {d['bandwidth_GBs']:.1f}")
PY

echo "# $(date -u '+%F %H:%M') UTC; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) CPUs; model $MODEL"
for r in $(seq 1 "$ROUNDS"); do
  for spec in $LLAMAS; do
    label=${spec%%=*}; bin=${spec#*=}
    wait_quiet
    line=$("$bin" -m "$MODEL" -t "$THREADS" -p 512 -n 64 -r 3 -o csv 2>/dev/null | python3 -c "$LLAMA_CSV")
    echo "round $r llama.cpp $label prompt/decode tok/s: $line"
  done
  for tier in $TIERS; do
    wait_quiet
    p=$(FREETOKEN_CPU_MOE_ISA=$tier "$FT" bench decode --model "$MODEL" --backend cpu --cpu-threads "$THREADS" --batch 1 \
        --prompt-len 512 --tokens 2 --repeats 2 --json 2>/dev/null | python3 -c "$FT_JSON" prompt || echo -)
    wait_quiet
    dec=$(FREETOKEN_CPU_MOE_ISA=$tier "$FT" bench decode --model "$MODEL" --backend cpu --cpu-threads "$THREADS" --batch 1 \
        --prompt-len 16 --tokens 65 --repeats 3 --json 2>/dev/null | python3 -c "$FT_JSON" decode || echo "- -")
    echo "round $r freetoken $tier prompt/decode tok/s, GB/s: $p $dec"
  done
done
