"""Attention for verification forwards (a few query positions per row) without
per-shape setup.

MLX's CUDA backend runs half-precision attention over more than one query position
with cuDNN, which builds a graph for every new (queries, keys, mask) shape: tens to
hundreds of milliseconds each (mlx/backend/cuda/scaled_dot_product_attention.cpp,
`supports_sdpa_cudnn`). A verification feeds [B, W] positions against a key length
that grows every step, so every verification would build one. While a verification
forward is built (`wide_attention`), half-precision attention over 2 or more query
positions is composed from plain ops instead -- two matmuls and a softmax, the same
kernels whatever the length -- which on a small W costs little anywhere. Single
positions and float32 (where no backend prepares per shape) keep MLX's fused kernel.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

__all__ = ["unfused_attention", "wide_attention"]

_fused = mx.fast.scaled_dot_product_attention


def unfused_attention(q, k, v, scale: float, mask=None) -> mx.array:
    """q [B, Hq, L, D], k and v [B, Hkv, S, D] (Hq a multiple of Hkv), mask None,
    "causal" (query i sees keys up to S - L + i) or an array broadcasting to
    [B, Hq, L, S] (bool: True = attend; else added to the scores) -> [B, Hq, L, D]."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qg = (q * scale).reshape(B, Hkv, rep, L, D)  # query heads grouped by their KV head
    scores = (qg @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # [B, Hkv, rep, L, S]
    if isinstance(mask, str):
        allowed = mx.arange(S)[None] <= (mx.arange(L) + (S - L))[:, None]  # [L, S]
        scores = mx.where(allowed, scores, -mx.inf)
    elif mask is not None:
        m = mask
        if m.ndim == 4:  # [B|1, Hq|1, L, S] -> grouped like the scores
            m = m.reshape(m.shape[0], -1, 1, L, S) if m.shape[1] == 1 else m.reshape(
                m.shape[0], Hkv, rep, L, S)
        scores = (mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_
                  else scores + m.astype(mx.float32))
    p = mx.softmax(scores, axis=-1).astype(q.dtype)
    return (p @ v[:, :, None]).reshape(B, Hq, L, D)


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if q.shape[2] < 2 or q.dtype == mx.float32 or sinks is not None or kw:
        return _fused(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
    return unfused_attention(q, k, v, scale, mask)


@contextmanager
def wide_attention():
    """While a verification forward is built (on the worker thread, which alone
    builds MLX graphs): attention through `_sdpa`."""
    mx.fast.scaled_dot_product_attention = _sdpa
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = _fused
