# Sourced by the scripts in tests/gpu that run on the GPU machine: compiled Triton kernels
# (no interpreter), one Triton cache, the carried wheels (.whl, see tests/gpu/wheels.txt) on
# PYTHONPATH, then freetoken-core, freetoken-cpu-moe and freetoken-cuda built in place.
# Defines OUT (created), T0 and stamp; returns 1 (after printing the log's tail) if the build fails.
OUT=${OUT:-/tmp/ft-out}; mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 FREETOKEN_CUDA_ARCH=${FREETOKEN_CUDA_ARCH:-90}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/ft-triton-cache}
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
: > "$OUT/build.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/build.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e ./freetoken-core -e ./freetoken-cpu-moe -e ./freetoken-cuda \
  >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
stamp "build done"
