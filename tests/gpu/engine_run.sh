#!/usr/bin/env bash
# One call on the GPU machine: install carried wheels (.whl), build core + cpu-moe + cuda,
# run the GPU engine tests (parity with the CPU backend, graphs, qualification faults,
# memory limit) and the decode-attention / dequantization GPU tests, then `freetoken bench
# decode` on a Qwen3-30B-A3B-shaped Q4_K_M file (all experts on the CPU, then half).
# Usage (repository root, .whl carried): bash tests/gpu/engine_run.sh [tests|bench|all] [LAYERS]
set -uo pipefail
WHAT=${1:-all}; LAYERS=${2:-48}
source tests/gpu/device_setup.sh || exit 1
if [ "$WHAT" != bench ]; then
  timeout 330 python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" tests/gpu/test_gpu_engine.py \
    tests/gpu/test_decode_attention.py tests/engine/test_dequant.py -o addopts="" --timeout 240 -x \
    > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
if [ "$WHAT" != tests ]; then
  M=/tmp/ft-bench/q4km-L$LAYERS.gguf; mkdir -p /tmp/ft-bench
  [ -f "$M" ] || timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
    --quant q4_k_m --threads 8 --out "$M" > "$OUT/make-model.log" 2>&1
  stamp "make-model rc=$? $(du -h $M | cut -f1)"
  for spec in all $((LAYERS / 2)); do
    timeout 240 python3 -m freetoken.cli.main bench decode --model "$M" --backend cuda --moe-cpu-layers "$spec" \
      --cpu-threads 15 --batch 1 8 --prompt-len 512 --gen-len 64 --repeats 1 --max-model-len 1024 --json \
      > "$OUT/bench-$spec.json" 2> "$OUT/bench-$spec.err"
    stamp "bench decode moe-cpu-layers=$spec rc=$?"
    python3 -c "import json,sys; d=json.load(open('$OUT/bench-$spec.json')); print(json.dumps(d)[:1500])" 2>/dev/null \
      || tail -5 "$OUT/bench-$spec.err"
  done
fi
stamp "all done"
