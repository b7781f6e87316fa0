#!/usr/bin/env bash
# Decode-only speed against llama.cpp in an interleaved series on a shared machine: per
# iteration llama-bench tg64 (-p 0 -n 64 -r 3), then `freetoken bench decode` (decode after a
# 16-token prompt, 65 tokens x 3) for each "TREE:TIER" given, each measurement started after
# the CPU was < QUIET% busy for 3 s (at most 40 tries). Adjacent measurements share the
# machine's state, so the per-iteration ratio is steadier than rounds minutes apart.
# Usage (repository root):
#   bash tests/cpu_moe/decode_series_vs_llamacpp.sh MODEL.gguf LLAMA_BENCH "TREE:TIER ..."
# e.g.  bash tests/cpu_moe/decode_series_vs_llamacpp.sh q3-8l.gguf .bench/llama-avx2/bin/llama-bench \
#         "$PWD:avx2 $PWD:avx_vnni /other/tree:avx2"
# TREE: a checkout whose freetoken-core/src and freetoken-cpu-moe/src (built in place) go on
# PYTHONPATH. Environment: N (8 iterations), THREADS (2), QUIET (10), FT (.venv/bin/freetoken).
# Prints one line per measurement: iteration, UTC time, what, tok/s (FreeToken: and read
# GB/s), the busy share before it and the 1-minute load average before and after.
set -uo pipefail
MODEL=$1; LLAMA=$2; RUNS=$3
N=${N:-8}; THREADS=${THREADS:-2}; QUIET=${QUIET:-10}; FT=${FT:-.venv/bin/freetoken}

busy() {
  read -r _ a b c d e f g _ < /proc/stat; local t1=$((a+b+c+d+e+f+g)) i1=$d
  sleep 3
  read -r _ a b c d e f g _ < /proc/stat; local t2=$((a+b+c+d+e+f+g)) i2=$d
  echo $(( 100 * ((t2-t1) - (i2-i1)) / (t2-t1) ))
}
wait_quiet() { local n=0 b; while b=$(busy); [ "$b" -ge "$QUIET" ] && [ $n -lt 40 ]; do n=$((n+1)); done; echo "$b"; }
load1() { cut -d' ' -f1 /proc/loadavg; }

echo "# $(date -u '+%F %H:%M') UTC; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) CPUs; model $MODEL"
for i in $(seq 1 "$N"); do
  q=$(wait_quiet); l0=$(load1); t=$(date -u +%T)
  r=$("$LLAMA" -m "$MODEL" -t "$THREADS" -p 0 -n 64 -r 3 -o csv 2>/dev/null \
      | python3 -c "import csv, sys; print(' '.join(f\"{float(r['avg_ts']):.1f}\" for r in csv.DictReader(sys.stdin)))")
  echo "iter $i $t llama.cpp tg64: ${r:--} | busy-before $q% load $l0 -> $(load1)"
  for spec in $RUNS; do
    tree=${spec%:*}; tier=${spec##*:}
    q=$(wait_quiet); l0=$(load1); t=$(date -u +%T)
    r=$(PYTHONPATH="$tree/freetoken-core/src:$tree/freetoken-cpu-moe/src" FREETOKEN_CPU_MOE_ISA=$tier "$FT" bench decode \
        --model "$MODEL" --backend cpu --cpu-threads "$THREADS" --batch 1 --prompt-len 16 --tokens 65 --repeats 3 --json 2>/dev/null \
        | python3 -c "import json, sys; d = json.load(sys.stdin); print(f\"{d['decode_tok_s']['1']:.1f} {d['bandwidth_GBs']:.1f}\")")
    echo "iter $i $t freetoken $tree $tier decode tok/s, GB/s: ${r:--} | busy-before $q% load $l0 -> $(load1)"
  done
done
