#!/usr/bin/env bash
# One call on the GPU machine: build, write a Qwen3-30B-A3B-shaped Q4_K_M file of LAYERS
# layers, then tests/gpu/profile_decode.py for each placement and `bench cpu-moe` (T=1)
# at a few thread counts: where a decode step's time goes. TESTS (GPU test files) run first.
# Usage (repository root, .whl carried): bash tests/gpu/profile_run.sh [LAYERS] [PLACEMENTS...]
set -uo pipefail
LAYERS=${1:-24}; shift || true
PLACEMENTS=${*:-all 0}
source tests/gpu/device_setup.sh || exit 1
if [ -n "${TESTS:-}" ]; then  # GPU test files to run first, e.g. TESTS="tests/gpu/test_dense_ops.py"
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" $TESTS -o addopts="" \
    > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
M=/tmp/ft-bench/q4km-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
[ -f "$M" ] || timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
  --quant q4_k_m --threads 16 --out "$M" > "$OUT/make-model.log" 2>&1
stamp "make-model rc=$? $(du -h $M | cut -f1)"
for spec in $PLACEMENTS; do
  timeout ${PROFILE_TIMEOUT:-150} python3 tests/gpu/profile_decode.py "$M" --moe-cpu-layers "$spec" ${PROFILE_ARGS:-} \
    > "$OUT/profile-$spec.txt" 2> "$OUT/profile-$spec.err"
  stamp "profile moe-cpu-layers=$spec rc=$?"
  grep -E "^(backend|step|host split|hand-off)" "$OUT/profile-$spec.txt" || tail -5 "$OUT/profile-$spec.err"
done
if [ -n "${CPU_MOE_THREADS:-}" ]; then
  for t in $CPU_MOE_THREADS; do
    timeout 60 python3 -m freetoken.cli.main bench cpu-moe --formats q4_k q6_k --tokens 1 --threads "$t" --seconds 1 \
      > "$OUT/cpu-moe-$t.txt" 2>&1
    stamp "cpu-moe threads=$t rc=$?"; tail -4 "$OUT/cpu-moe-$t.txt"
  done
fi
stamp "all done"
