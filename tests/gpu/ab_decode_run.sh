#!/usr/bin/env bash
# One call on the GPU machine: `freetoken bench decode` of two trees of the Python code in
# alternating runs on the same file, for a before/after comparison of a change that leaves
# the native code alone. The working tree is built as usual (tests/gpu/device_setup.sh); the
# other tree ($BEFORE, a `git archive` of the older commit carried as an ignored folder) runs
# from PYTHONPATH with this build's native extensions copied in.
# Placements: PLACEMENTS (default "limit:16GiB cpu:all"): limit:SIZE = --gpu-memory-limit SIZE,
# cpu:SPEC = --moe-cpu-layers SPEC. ROUNDS (2) rounds, each: per placement before, then after.
# The file: make-model's PRESET (default qwen3-30b-a3b) cut to LAYERS (48) layers in QUANT (q4_k_m;
# mxfp4 for gpt-oss-120b), made once under /tmp/ft-bench.
# Usage (repository root, .whl and $BEFORE carried): BEFORE=.before bash tests/gpu/ab_decode_run.sh
#   e.g. BEFORE=.before PRESET=glm-4.5-air LAYERS=20 PLACEMENTS=limit:24576MiB bash tests/gpu/ab_decode_run.sh
set -uo pipefail
BEFORE=${BEFORE:-.before}; LAYERS=${LAYERS:-48}; ROUNDS=${ROUNDS:-2}
PRESET=${PRESET:-qwen3-30b-a3b}; QUANT=${QUANT:-q4_k_m}
PLACEMENTS=${PLACEMENTS:-"limit:16GiB cpu:all"}
source tests/gpu/device_setup.sh || exit 1
for so in freetoken-cpu-moe/src/freetoken_cpu_moe/_core*.so freetoken-cuda/src/freetoken_cuda/_C*.so; do
  cp "$so" "$BEFORE/${so%/*}/" || { echo "no native extension $so to copy"; exit 1; }
done
M=/tmp/ft-bench/$PRESET-$QUANT-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
# (the default file under the name the other scripts of tests/gpu give it, so a warm machine reuses it)
[ "$PRESET-$QUANT" = qwen3-30b-a3b-q4_k_m ] && M=/tmp/ft-bench/q4km-L$LAYERS.gguf
[ -f "$M" ] || timeout 200 python3 -m freetoken.cli.main bench make-model --preset "$PRESET" --layers "$LAYERS" \
  --quant "$QUANT" --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1
stamp "make-model rc=$? $(du -h "$M" | cut -f1)"
BEFORE_PATH="$PWD/$BEFORE/freetoken-core/src:$PWD/$BEFORE/freetoken-cpu-moe/src:$PWD/$BEFORE/freetoken-cuda/src"
run() {  # run TREE PLACEMENT ROUND
  local tree=$1 place=$2 r=$3 args path=${PYTHONPATH:-}
  case $place in limit:*) args="--gpu-memory-limit ${place#limit:}";; cpu:*) args="--moe-cpu-layers ${place#cpu:}";; esac
  [ "$tree" = before ] && path="$BEFORE_PATH${PYTHONPATH:+:$PYTHONPATH}"
  local tag="$tree-${place//[:\/]/_}-$r"
  # shellcheck disable=SC2086
  PYTHONPATH=$path timeout 170 python3 -c "import sys, freetoken; print(freetoken.__file__, file=sys.stderr)
from freetoken.cli.main import main; sys.exit(main(sys.argv[1:]))" bench decode --model "$M" --backend cuda --cpu-threads 15 \
    --batch 1 --prompt-len 512 --gen-len 64 --repeats 3 --max-model-len 1024 $args --json \
    > "$OUT/$tag.json" 2> "$OUT/$tag.err"
  local rc=$?
  python3 - "$OUT/$tag.json" "$tree" "$place" "$r" "$rc" "$(grep -m1 -o '/[^ ]*freetoken/__init__.py' "$OUT/$tag.err")" <<'PY'
import json, sys
path, tree, place, r, rc, where = sys.argv[1:]
try:
    d = json.load(open(path))
    print(f"{place} round {r} {tree}: decode {d['decode_tok_s']['1']:.1f} tok/s, prompt {d['prompt_tok_s']['1']:.0f} tok/s "
          f"(runs {d['batches']['1']['decode_tok_s_runs']}) [{where}]")
except Exception as exc:  # noqa: BLE001 - a failed run prints why
    print(f"{place} round {r} {tree}: rc={rc}, no result ({type(exc).__name__}) [{where}]")
PY
  [ $rc -eq 0 ] || tail -4 "$OUT/$tag.err"
}
for r in $(seq 1 "$ROUNDS"); do  # every placement once per round: a call cut short keeps each
  for place in $PLACEMENTS; do
    run before "$place" "$r"; run after "$place" "$r"
  done
done
stamp "all done"
