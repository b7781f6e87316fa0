#!/usr/bin/env bash
# One call on the GPU machine: build core + cpu-moe + cuda for its python, run the GPU
# tests (all of tests/gpu: kernels, hand-off, the engine against references, the HTTP server
# through the openai client), the qualification tests, the GPU dequantization tests, doctor,
# and the moe-layer benchmark; logs under $OUT. Carried wheels in .whl are installed first.
# Stage time limits: pytest $PYTEST_TIMEOUT (420 s), doctor 50 s, bench 180 s.
# Usage (from the repository root): bash tests/gpu/device_run.sh [tests|bench|all]
set -uo pipefail
WHAT=${1:-all}
source tests/gpu/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee "$OUT/versions.txt"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -p no:cacheprovider -v -rs -m "gpu or not gpu" tests/gpu tests/qualify \
    tests/engine/test_dequant.py -o addopts="" --timeout 240 --durations=15 -o log_cli=false 2>&1 > "$OUT/pytest.log"
  stamp "pytest rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest.log" | grep -v test_triton_moe | sed 's/ *\[.*%\]//' | tail -45
  echo "-- fused MoE kernels (tests/gpu/test_triton_moe*.py):"
  grep -E "test_triton_moe" "$OUT/pytest.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED" | sed 's/ *\[.*%\]//' \
    | awk '{print $2}' | sort | uniq -c
  grep -E "test_triton_moe.*(FAILED|ERROR)" "$OUT/pytest.log" | sed 's/ *\[.*%\]//' | head -20
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -30
  grep -E "^[0-9.]+s (call|setup)" "$OUT/pytest.log" | head -15
  tail -3 "$OUT/pytest.log"
  timeout 50 python3 -m freetoken.cli.main doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
  stamp "doctor rc=$?"; python3 -c "import json; d=json.load(open('$OUT/doctor.json')); print(json.dumps({k: d.get(k) for k in ('selection', 'capabilities', 'qualification', 'handoff')})[:2500])"
  tail -3 "$OUT/doctor.err"
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  # 3 worker processes; bench.json is rewritten after each, so a cut-short run keeps what it measured
  timeout 180 python3 -m freetoken.cli.main bench moe-layer --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.err"
  stamp "bench rc=$?"; cat "$OUT/bench.txt"; grep -iE "error|failed|Traceback" "$OUT/bench.err" | head -10; tail -3 "$OUT/bench.err"
  [ -s "$OUT/bench.txt" ] || python3 -c "
import json; s=json.load(open('$OUT/bench.json'))['summary']
print('partial summary,', s['processes'], 'processes'); print(json.dumps(s, indent=1)[:5000])" 2>&1
fi
stamp "all done"
