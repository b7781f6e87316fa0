#!/usr/bin/env bash
# Nsight Compute on the packed decode kernels (gate/up, down, dense GEMV) with the default tiles,
# one Qwen3-30B-A3B layer's shapes at T = 1 (tests/gpu/tune_cold.py --launch-only): occupancy,
# registers, warp stall reasons, memory throughput. ncu flushes the caches before each profiled
# launch, so every launch reads its weights from HBM, as in a model. The clocks are left alone.
# Usage (GPU machine, after tests/gpu/device_setup.sh): bash tests/gpu/ncu_packed.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/ft-out}}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
# every launch: 4 of gate/up, 4 of down, 4 of each dense GEMV, each on other weights
"$NCU" --clock-control none --cache-control all \
  --kernel-name regex:"_gate_up_packed_kernel|_down_packed_kernel|_packed_gemv_kernel" --launch-count 16 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 tests/gpu/tune_cold.py --launch-only > "$OUT/ncu-packed.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  _|Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Grid Size|Block Size|Stall|Issued Warp|No Eligible|Executed Ipc|Issue Slots Busy|Executed Instructions" \
  "$OUT/ncu-packed.txt" | head -150
