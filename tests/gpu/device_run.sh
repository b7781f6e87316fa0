#!/usr/bin/env bash
# One call on the GPU machine: build core + cpu-moe + cuda for its python, run the GPU
# tests, the qualification tests, doctor, and the moe-layer benchmark; logs under $OUT.
# Usage (from the repository root): bash tests/gpu/device_run.sh [tests|bench|all]
set -uo pipefail
WHAT=${1:-all}
OUT=${OUT:-/tmp/ft-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FREETOKEN_CUDA_ARCH=${FREETOKEN_CUDA_ARCH:-90}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e ./freetoken-core -e ./freetoken-cpu-moe -e ./freetoken-cuda \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout 330 python3 -m pytest -p no:cacheprovider -v -rs -m "gpu or not gpu" tests/gpu tests/qualify \
    -o addopts="" --timeout 120 2>&1 > "$OUT/pytest.log"
  echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest.log" | sed 's/ *\[.*%\]//' | tail -60
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -30
  timeout 120 python3 -m freetoken.cli.main doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
  echo "doctor rc=$?"; python3 -c "import json; d=json.load(open('$OUT/doctor.json')); print(json.dumps({k: d.get(k) for k in ('selection', 'capabilities', 'qualification', 'handoff')})[:2500])"
  tail -3 "$OUT/doctor.err"
  python3 -c "
import json, torch
from freetoken.backends.registry import get_backend
from freetoken.moe.qualify import doctor_section
b = get_backend()
print(json.dumps({'capabilities': b.capabilities().as_dict(), 'qualification': doctor_section(b)}, default=str, indent=1))
" > "$OUT/qualify_section.json" 2>&1; echo "doctor_section rc=$?"; head -c 4000 "$OUT/qualify_section.json"
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  timeout 240 python3 -m freetoken.cli.main bench moe-layer --json "$OUT/bench.json" 2> "$OUT/bench.err"
  echo "bench rc=$?"; tail -5 "$OUT/bench.err"
fi
