#!/usr/bin/env bash
# One call on the GPU machine: tests/gpu/bench_vs_llamacpp.sh for several make-model presets in turn, each
# cut to a number of layers, against llama.cpp's largest placement within a card size. Each model file is
# removed after its run (the disk holds about two of 30 GiB). llama.cpp should be carried prebuilt
# (tests/gpu/build_llamacpp_cuda.sh: .bench/llama-cuda.tar.xz, unpacked by tests/gpu/llamacpp_libs.sh),
# else each preset's run builds it.
#   PRESETS   "NAME:LAYERS ..." (default "deepseek-v3:7 gpt-oss-120b:16")
#   CARD_MIB  the simulated card (default 24576): LLAMA_FIT_MIB for llama.cpp, --gpu-memory-limit for FreeToken
#   PRESET_BUDGET_S  seconds for each preset's run (default 270)
#   PRESET_PLACEMENTS  FreeToken's placements (FT_PLACEMENTS of bench_vs_llamacpp.sh; default "limit:CARD_MIBMiB all")
# Returned under $OUT: each preset's summary.txt and freetoken-bench.log (PRESET-summary.txt, PRESET-freetoken.log).
# Usage (repository root; .whl and .bench/llama-cuda.tar.xz carried): bash tests/gpu/presets_run.sh
set -uo pipefail
PRESETS=${PRESETS:-"deepseek-v3:7 gpt-oss-120b:16"}
CARD_MIB=${CARD_MIB:-24576}
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
skip_setup=${SKIP_SETUP:-0}  # 1: the python3 environment already has everything built
for spec in $PRESETS; do
  preset=${spec%%:*} layers=${spec#*:}
  run_out=/tmp/ft-out-$preset
  rm -rf "$run_out"
  echo "== $preset, $layers layers, card $CARD_MIB MiB"
  OUT=$run_out SKIP_SETUP=$skip_setup LLAMA_FIT_MIB=$CARD_MIB FT_PLACEMENTS=${PRESET_PLACEMENTS:-"limit:${CARD_MIB}MiB all"} FT_BATCHES=1 \
    LLAMA_ALL_GPU=0 REPS=${REPS:-1} BUDGET_S=${PRESET_BUDGET_S:-270} \
    bash tests/gpu/bench_vs_llamacpp.sh --preset "$preset" --layers "$layers"
  cp "$run_out/summary.txt" "$OUT/$preset-summary.txt" 2>/dev/null
  cp "$run_out/freetoken-bench.log" "$OUT/$preset-freetoken.log" 2>/dev/null
  rm -f /tmp/ft-bench/"$preset"-*.gguf /tmp/ft-bench/"$preset"-*.gguf.ok
  skip_setup=1  # the first run installed and built everything
done
