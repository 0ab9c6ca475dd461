"""The continuous-batching engine: the loop side here, the MLX side in `worker/`."""
