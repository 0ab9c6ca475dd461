#!/usr/bin/env bash
# A benchmark on an NVIDIA GPU through MLX's CUDA backend (bench/README.md).
#   bash bench/gpu_run.sh <benchmark> [options...]    result files and log.txt -> $OUT
# Runs the checkout's mlxnb/ (PYTHONPATH), with the python3 on PATH, which needs
# `pip install 'mlx[cuda13]' mlx-lm` (mlx[cuda12] for CUDA 12 drivers).
#   MLX_WHEELS=DIR   offline machine: install the mlx and mlx-lm wheels found in DIR
#                    into a private folder first (no index, no dependencies)
#   SAVE_PTX=1       also write $OUT/ptx.tgz, MLX's compiled-kernel cache;
#   PTX_TGZ=FILE     unpack such a cache first, so a fresh machine skips compiling
set -o pipefail
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
PYPATH=$PWD
if [ -n "$MLX_WHEELS" ]; then
  SITE=${SITE:-$OUT/site}
  [ -d "$SITE/mlx" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" "$MLX_WHEELS"/*.whl || { echo "installing $MLX_WHEELS/*.whl failed"; exit 1; }
  PYPATH=$SITE:$PWD
fi
# MLX compiles each CUDA kernel on first use and caches the PTX on disk (the 4-bit
# kernels alone take ~130 s on a fresh machine); a saved cache skips that.
if [ -z "$MLX_PTX_CACHE_DIR" ]; then
  export MLX_PTX_CACHE_DIR=$OUT/ptx
  [ -n "$PTX_TGZ" ] && [ ! -d "$MLX_PTX_CACHE_DIR" ] && tar xzf "$PTX_TGZ" -C "$OUT"
fi
export PYTHONPATH=$PYPATH PYTHONUNBUFFERED=1 MLXNB_OPENBLAS=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import mlx.core as mx, sys; print(mx.default_device(), mx.__version__); sys.exit(not mx.cuda.is_available())" || {
  echo "MLX sees no CUDA GPU: pip install 'mlx[cuda13]' mlx-lm (mlx[cuda12] for CUDA 12 drivers)"; exit 1; }
python3 -m bench "$@" --out "$OUT" 2>&1 | tee "$OUT/log.txt"
rc=$?
if [ -n "$SAVE_PTX" ]; then
  (cd "$(dirname "$MLX_PTX_CACHE_DIR")" && tar czf "$OUT/ptx.tgz" "$(basename "$MLX_PTX_CACHE_DIR")")
fi
exit $rc
