#!/usr/bin/env bash
# One call on the GPU machine: every expert on the GPU, the 48-layer Qwen3-30B-A3B-shaped Q4_K_M
# file, prompt 512 and decode at batch 1 for each dense form and grouped-kernel tile of FORMS,
# beside llama-bench on the same file (`-ngl 99`, pp512 and tg64) in the same call.
#   FORMS  space-separated FORM[@KIND:FIELDS[@KIND:FIELDS...]]: FORM a --gpu-dense value, each
#          KIND:FIELDS a `bench decode --tiles` argument, e.g. "dequantized packed both
#          dequantized@grouped:block_m=64" (the default)
#   TESTS  GPU test files (pytest arguments) run beside make-model
#   REPEATS  runs per form (default 2)
#   BATCHES  `bench decode --batch` sizes (default 1)
#   VOCAB    bpe: the file is written with token texts, the one tests/gpu/serve_vs_llamacpp.sh
#            uses (a later call on the same machine reuses it); default: the synthetic vocabulary
#   PROFILE  a --gpu-dense value: tests/gpu/profile_decode.py with every expert on the GPU and
#            that form, its 512-token prompt profiled and its host waits listed (--prompt-syncs)
# Usage (repository root; .whl and .bench/llama-cuda.tar.xz carried: tests/gpu/llamacpp_libs.sh
# unpacks it): bash tests/gpu/all_gpu_forms_run.sh
set -uo pipefail
FORMS=${FORMS:-"dequantized packed both dequantized@grouped:block_m=64"}
LAYERS=48
source tests/gpu/device_setup.sh || exit 1
B=${LLAMACPP_BUILD:-/tmp/llamacpp-build}
source tests/gpu/llamacpp_libs.sh "$B"
M=/tmp/ft-bench/qwen3-30b-a3b-q4_k_m-L$LAYERS${VOCAB:+-$VOCAB}.gguf; mkdir -p /tmp/ft-bench
if [ -n "${TESTS:-}" ]; then
  ( eval "timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -o addopts='' -m 'gpu or not gpu' $TESTS" \
      > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest.txt" ) &
  TESTS_PID=$!
fi
if [ ! -f "$M.ok" ]; then
  timeout 200 python3 -m freetoken.cli.main bench make-model --preset qwen3-30b-a3b --layers "$LAYERS" \
    --quant q4_k_m --threads 16 ${VOCAB:+--vocab "$VOCAB"} --out "$M" > "$OUT/make-model.log" 2>&1 && touch "$M.ok"
fi
stamp "make-model $( [ -f "$M.ok" ] && echo ok || echo FAILED)"
if [ -n "${TESTS_PID:-}" ]; then
  wait "$TESTS_PID"; pkill -9 -f "python3 -m pytest" 2>/dev/null
  stamp "GPU tests: $(grep -E 'passed|failed' "$OUT/pytest.txt" | tail -1)"
fi
if [ -x "$B/bin/llama-bench" ]; then
  timeout 150 "$B/bin/llama-bench" -m "$M" -t 16 -ngl 99 -p 512 -n 64 -r "${LLAMA_REPS:-2}" -o md > "$OUT/llama-bench.md" 2>&1
  stamp "llama-bench rc=$?"; grep -E "pp512|tg64" "$OUT/llama-bench.md"
fi
for spec in $FORMS; do
  IFS='@' read -ra parts <<< "$spec"
  args=(--gpu-dense "${parts[0]}")
  for t in "${parts[@]:1}"; do args+=(--tiles "$t"); done
  tag=$(echo "$spec" | tr -c 'a-zA-Z0-9\n' '_')
  timeout "${FORM_TIMEOUT:-120}" python3 -m freetoken.cli.main bench decode --model "$M" --backend cuda \
    --moe-cpu-layers 0 --batch ${BATCHES:-1} --prompt-len 512 --gen-len 64 --repeats "${REPEATS:-2}" --max-model-len 1024 \
    "${args[@]}" > "$OUT/form-$tag.txt" 2>&1
  stamp "$spec rc=$?"
  grep -E "^ *[0-9]+ |decode tok/s of each run|prompt tok/s of each run|GPU memory" "$OUT/form-$tag.txt" | head -9
done
if [ -n "${PROFILE:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-150}" python3 tests/gpu/profile_decode.py "$M" --moe-cpu-layers 0 --gpu-dense "$PROFILE" \
    --steps 24 --prompt-profile 512 --prompt-syncs > "$OUT/profile-$PROFILE.txt" 2> "$OUT/profile-$PROFILE.err"
  stamp "profile $PROFILE rc=$?"
  grep -E "^(step|host split|prompt [0-9])" "$OUT/profile-$PROFILE.txt" || tail -5 "$OUT/profile-$PROFILE.err"
  sed -n '/^prompt syncs/,/^$/p' "$OUT/profile-$PROFILE.txt" | head -20
  grep -E "^timeline" "$OUT/profile-$PROFILE.txt"
fi
stamp "all done"
