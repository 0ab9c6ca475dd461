"""mlxnb's benchmarks: `python -m bench --help` lists them; bench/README.md says what
each measures and where its results go."""

# Before any benchmark module imports MLX, whatever its own import order: on a Linux
# CPU mlxnb puts OpenBLAS under MLX (mlxnb/models/blas.py), which only works before
# MLX loads; a benchmark that loaded MLX first measured MLX's own ~3x slower matmuls,
# not what users of the engine get. (`import mlxnb` itself does not load MLX.)
import mlxnb  # noqa: F401
