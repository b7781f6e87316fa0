#!/usr/bin/env bash
# One call on the GPU machine: build core + cpu-moe + cuda for its python, run the GPU
# tests, the qualification tests, the GPU dequantization tests, doctor, and the moe-layer
# benchmark; logs under $OUT. Carried wheels in .whl are installed first.
# The tests run in two stages: the engine-level files (engine, expert traffic, server,
# families, hand-off) one at a time in one process: each of their engines starts a pool of
# spinning CPU threads sized to the machine, and two at once starve each other (in one run
# four such files in parallel finished no test in 330 s); then the kernel files (no engine,
# no CPU pool) in $KERNEL_WORKERS pytest-xdist workers (Triton compiles on the CPU, so they
# share the 16 cores well). ENGINE_FILES / KERNEL_FILES replace either list. Time limits:
# engine stage $ENGINE_TIMEOUT (280 s), kernel stage $KERNEL_TIMEOUT (210 s), doctor 50 s,
# bench 180 s. Logs: pytest-engine.log, pytest-kernels.log.
# Usage (from the repository root): bash tests/gpu/device_run.sh [tests|bench|all]
set -uo pipefail
WHAT=${1:-all}
source tests/gpu/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee "$OUT/versions.txt"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  G=tests/gpu
  KERNEL_FILES=${KERNEL_FILES:-"$G/test_triton_moe.py $G/test_triton_moe_compile.py $G/test_packed_experts.py $G/test_grouped_experts.py
    $G/test_packed_dense.py $G/test_layer_parts.py $G/test_dense_ops.py $G/test_decode_attention.py tests/engine/test_dequant.py
    $G/test_cache_pool_kernels.py $G/test_route_slots.py $G/test_expert_gather.py tests/engine/test_device_sampling.py"}
  ENGINE_FILES=${ENGINE_FILES:-"$G/test_gpu_engine.py $G/test_gpu_expert_traffic.py $G/test_families_gpu.py $G/test_gpu_server.py
    $G/test_handoff_gpu.py $G/test_handoff_sync_policy.py $G/test_gpu_packages.py $G/test_bench_moe_layer.py tests/qualify"}
  # shellcheck disable=SC2086
  timeout ${ENGINE_TIMEOUT:-280} python3 -m pytest -p no:cacheprovider -v -rs -m "gpu or not gpu" $ENGINE_FILES \
    -o addopts="" --timeout 240 --durations=10 -o log_cli=false > "$OUT/pytest-engine.log" 2>&1
  stamp "engine tests rc=$?"
  # shellcheck disable=SC2086
  timeout ${KERNEL_TIMEOUT:-210} python3 -m pytest -p no:cacheprovider -v -rs -m "gpu or not gpu" -n ${KERNEL_WORKERS:-6} \
    $KERNEL_FILES -o addopts="" --timeout 200 -o log_cli=false > "$OUT/pytest-kernels.log" 2>&1
  stamp "kernel tests rc=$?"
  for log in "$OUT/pytest-engine.log" "$OUT/pytest-kernels.log"; do
    echo "-- $(basename "$log"): $(grep -cE " PASSED" "$log") passed, $(grep -cE " FAILED| ERROR" "$log") failed/errors, $(grep -cE " SKIPPED" "$log") skipped"
    grep -E " (FAILED|ERROR) " "$log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort -u | head -20
    grep -E "^E " "$log" | head -15
    tail -1 "$log"
  done
  # tests a cut-short stage started but did not finish (verbose lines name each test as it starts)
  python3 - "$OUT/pytest-kernels.log" "$OUT/pytest-engine.log" <<'PY'
import re, sys
for path in sys.argv[1:]:
    text = open(path, errors="replace").read()
    done = set(re.findall(r"(?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(tests/\S+)", text))
    done |= set(re.findall(r"(tests/\S+::\S+) (?:PASSED|FAILED|ERROR|SKIPPED)", text))
    started = set(re.findall(r"^(tests/\S+::\S+)", text, re.M))
    left = sorted(started - done)
    if left:
        print(f"-- {path.rsplit('/', 1)[-1]}: started, not finished: {len(left)}:", " ".join(left[:12]))
PY
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
