#!/usr/bin/env bash
# One call on the GPU machine: build, run GPU test files (TESTS), write a Qwen3-30B-A3B-shaped
# Q4_K_M file of LAYERS layers, then `freetoken bench decode` once per run in RUNS, a list of
# "TAG:FLAGS" items separated by ';' (e.g. "packed:--moe-cpu-layers 0;16g:--gpu-memory-limit 16GiB";
# other kernel tiles: "fast:--tiles experts:down_routes_tile=1,block_n=2");
# RUN_ENV_<TAG> adds environment variables to that run only (e.g. RUN_ENV_torch="FREETOKEN_DENSE_OPS=torch").
# SKEW=S: the file's routers favour some experts (bench make-model --router-skew S), for cache runs.
# Usage (repository root, .whl carried): RUNS="..." TESTS="..." [SKEW=4] bash tests/gpu/moe_runs.sh [LAYERS]
set -uo pipefail
LAYERS=${1:-48}
source tests/gpu/device_setup.sh || exit 1
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not gpu" $TESTS -o addopts="" \
    > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  grep -E "^E " "$OUT/pytest.log" | head -20
fi
[ -n "${RUNS:-}" ] || { stamp "no RUNS"; exit 0; }
# SKEW=S writes (and runs) a model whose routers favour some experts (make-model --router-skew S)
M=/tmp/ft-bench/q4km-L$LAYERS${SKEW:+-skew$SKEW}.gguf; mkdir -p /tmp/ft-bench
[ -f "$M" ] || timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
  --quant q4_k_m --threads 16 ${SKEW:+--router-skew "$SKEW"} --out "$M" > "$OUT/make-model.log" 2>&1
stamp "make-model rc=$? $(du -h $M | cut -f1)"
IFS=';' read -ra items <<< "$RUNS"
for item in "${items[@]}"; do
  tag=${item%%:*}; flags=${item#*:}; envvar="RUN_ENV_$tag"
  # shellcheck disable=SC2086
  timeout ${RUN_TIMEOUT:-150} env ${!envvar:-} python3 -m freetoken.cli.main bench decode --model "$M" --backend cuda --cpu-threads 15 \
    --batch ${BATCHES:-1 8} --prompt-len ${PROMPT_LEN:-512} --gen-len ${GEN_LEN:-64} --repeats 1 --max-model-len 1024 \
    --json $flags > "$OUT/run-$tag.json" 2> "$OUT/run-$tag.err"
  rc=$?
  stamp "run $tag (${!envvar:-} $flags) rc=$rc"
  python3 - "$OUT/run-$tag.json" <<'PY' || tail -4 "$OUT/run-$tag.err"
import json, sys
d = json.load(open(sys.argv[1]))
rep = d["backend_report"]; plan = rep.get("memory_plan") or {}
print(f"  host read bandwidth {d.get('bandwidth_GBs') or 0:.1f} GB/s before, {d.get('bandwidth_GBs_after') or 0:.1f} after")
for b, v in d["batches"].items():
    print(f"  batch {b}: prompt {v['prompt_tok_s']:.1f} tok/s, decode {v['decode_tok_s']:.1f} tok/s, "
          f"gpu max alloc {(v.get('gpu_max_allocated_bytes') or 0) / 2**30:.2f} GiB")
print("  plan:", json.dumps({k: plan.get(k) for k in ("gpu_layers", "packed_layers", "cpu_layers", "expert_bytes",
                                                       "cache", "scratch", "kv_budget")}))
for k in ("moe_stats", "expert_cache", "prefill_stream", "stages_b1_us"):
    if rep.get(k) or d.get(k):
        print(f"  {k}:", json.dumps(rep.get(k) or d.get(k))[:600])
PY
done
stamp "all done"
