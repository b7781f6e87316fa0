#!/usr/bin/env bash
# One call on the GPU machine: build, write a Q4_K_M file of LAYERS layers of a make-model preset
# (PRESET, default qwen3-30b-a3b; QUANT another make-model --quant, e.g. mxfp4 for GPT-OSS), then
# tests/gpu/profile_decode.py for each placement and `bench cpu-moe` (T=1)
# at a few thread counts: where a decode step's time goes. TESTS (GPU test files and pytest
# arguments) run while the file is written. A placement is a --moe-cpu-layers value, or
# limit:SIZE (the default placement under --gpu-memory-limit SIZE), then optionally
# @FIELD=VALUE,... (EngineConfig fields, e.g. limit:16GiB@moe_stream_experts=all).
# Usage (repository root, .whl carried): bash tests/gpu/profile_run.sh [LAYERS] [PLACEMENTS...]
set -uo pipefail
LAYERS=${1:-24}; shift || true
PLACEMENTS=${*:-all 0}
source tests/gpu/device_setup.sh || exit 1
PRESET=${PRESET:-qwen3-30b-a3b}; QUANT=${QUANT:-q4_k_m}
M=/tmp/ft-bench/$PRESET-$QUANT-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
[ -f "$M" ] || { timeout 240 python3 -m freetoken.cli.main bench make-model --preset "$PRESET" --layers "$LAYERS" \
  --quant "$QUANT" --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1; echo "rc=$?" >> "$OUT/make-model.log"; } &
MAKE=$!
if [ -n "${TESTS:-}" ]; then  # pytest arguments, quoted as in a shell: TESTS="tests/gpu/x.py -k 'a or b'"
  eval "timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -v -rs -m 'gpu or not gpu' $TESTS \
    -o addopts='' > '$OUT/pytest.log' 2>&1"
  rc=$?; pkill -9 -f "python3 -m pytest" 2>/dev/null  # nothing of a cut stage left spinning
  stamp "pytest rc=$rc"; grep -E " (FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
wait $MAKE
stamp "make-model $(tail -1 "$OUT/make-model.log" 2>/dev/null) $(du -h $M | cut -f1)"
if [ -n "${DMA:-}" ]; then  # host memory shared by the CPU experts and PCIe reads (tests/gpu/dma_contention.py)
  cpu() { timeout 60 python3 -m freetoken.cli.main bench cpu-moe --formats q4_k q6_k --tokens 1 --threads 15 --seconds 3 \
    2>&1 | grep -iE "GB/s|q4_k|q6_k" | head -6; }
  { echo "## CPU alone"; cpu
    for g in $DMA; do echo "## gather $g alone"; timeout 30 python3 tests/gpu/dma_contention.py --gather "$g" --seconds 3; done
    echo "## CPU beside copy-engine copies"; timeout 40 python3 tests/gpu/dma_contention.py --seconds 16 & sleep 6; cpu; wait
    for g in $DMA; do echo "## CPU beside gather $g"; timeout 40 python3 tests/gpu/dma_contention.py --gather "$g" --seconds 16 & sleep 9; cpu; wait; done
  } > "$OUT/dma.txt" 2>&1
  stamp "dma contention"; cat "$OUT/dma.txt"
fi
for spec in $PLACEMENTS; do
  args=()
  tag=${spec//[^a-zA-Z0-9.=_-]/_}
  case $spec in *@*) IFS=',' read -ra sets <<< "${spec#*@}"; for kv in "${sets[@]}"; do args+=(--set "$kv"); done
    spec=${spec%%@*} ;; esac
  case $spec in limit:*) args+=(--gpu-memory-limit "${spec#limit:}") ;; *) args+=(--moe-cpu-layers "$spec") ;; esac
  # shellcheck disable=SC2086
  timeout ${PROFILE_TIMEOUT:-150} python3 tests/gpu/profile_decode.py "$M" "${args[@]}" ${PROFILE_ARGS:-} \
    > "$OUT/profile-$tag.txt" 2> "$OUT/profile-$tag.err"
  stamp "profile $tag rc=$?"
  grep -E "^(backend|plan|step|host split|hand-off|prompt [0-9])" "$OUT/profile-$tag.txt" || tail -5 "$OUT/profile-$tag.err"
  sed -n '/^timeline/,$p' "$OUT/profile-$tag.txt" | head -30
done
if [ -n "${CPU_MOE_THREADS:-}" ]; then
  for t in $CPU_MOE_THREADS; do
    timeout 60 python3 -m freetoken.cli.main bench cpu-moe --formats q4_k q6_k --tokens 1 --threads "$t" --seconds 1 \
      > "$OUT/cpu-moe-$t.txt" 2>&1
    stamp "cpu-moe threads=$t rc=$?"; tail -4 "$OUT/cpu-moe-$t.txt"
  done
fi
stamp "all done"
