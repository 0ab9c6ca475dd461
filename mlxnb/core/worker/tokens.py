"""One integer type for token ids and row indices on the device: uint32.

MLX's CUDA backend JIT-compiles a gather kernel per (data type, index type) on its
first use on a machine: 4-10 s each on an H200
(bench/results/cold-start-2026-11-29-h200.md).
Sampled tokens are uint32 (argmax, the Gumbel draw), and a concatenate of int32
prompt ids with them promotes to int64; with mixed types a fresh engine compiled
the embedding lookup three times (int32, uint32, int64 ids) and the row filters twice
more. With one type the embedding lookup and the caches' row filters share one
kernel per model dtype, and the token vector, counters and seeds share another.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

__all__ = ["TOKEN", "ids"]

TOKEN = mx.uint32


def ids(values: Sequence) -> mx.array:
    """Token ids or row positions (non-negative ints, nested lists) as a TOKEN array."""
    return mx.array(values, dtype=TOKEN)
