"""MLX batch execution: everything in this package runs on the engine's worker thread."""
