#!/usr/bin/env bash
# Device side of an H200 run (shared/notes/gpu.md, call 2). Needs /tmp/part_aa from
# call 1 and .gpu2/ carried (part_ab + the mlx and mlx-lm wheels). If .gpu2/src/mlxnb
# exists (a snapshot of the package), it is used instead of the checkout's mlxnb/.
#   bash bench/gpu_run.sh [engine_bench.py args...]     results -> $OUT
#   bash bench/gpu_run.sh bench/other.py [args...]       its output -> $OUT/log.txt
#   SAVE_PTX=1 ...   also $OUT/ptx.tgz, MLX's kernel cache: keep it as .gpu2/ptx.tgz
set -o pipefail
W=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
if [ ! -d /tmp/site/mlx ]; then
  cat /tmp/part_aa .gpu2/part_ab > "$W" &&
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$W" .gpu2/mlx-0.32.4-*.whl .gpu2/mlx_lm-*.whl || { echo "mlx install failed"; exit 1; }
fi
SRC=$PWD
[ -d .gpu2/src/mlxnb ] && SRC=$PWD/.gpu2/src
# MLX compiles CUDA kernels on first use and caches the PTX (4-bit: ~130 s on a fresh
# machine). A cache brought back from an earlier call (SAVE_PTX=1) is reused.
if [ -z "$MLX_PTX_CACHE_DIR" ]; then
  export MLX_PTX_CACHE_DIR=/tmp/ptx
  [ -f .gpu2/ptx.tgz ] && [ ! -d /tmp/ptx ] && tar xzf .gpu2/ptx.tgz -C /tmp
fi
export PYTHONPATH=/tmp/site:$SRC PYTHONUNBUFFERED=1 MLXNB_OPENBLAS=0
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import mlx.core as mx; print(mx.default_device(), mx.__version__)" || exit 1
if [[ "$1" == *.py ]]; then
  python3 "$@" 2>&1 | tee "$OUT/log.txt"
else
  python3 bench/engine_bench.py "$@" --out "$OUT" 2>&1 | tee "$OUT/log.txt"
fi
rc=$?
if [ -n "$SAVE_PTX" ]; then
  (cd "$(dirname "$MLX_PTX_CACHE_DIR")" && tar czf "$OUT/ptx.tgz" "$(basename "$MLX_PTX_CACHE_DIR")")
fi
exit $rc
