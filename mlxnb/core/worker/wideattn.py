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
On CUDA, where the engine has turned it on (`use_kernel`, after its check on the
device), a verification of up to 16 positions, causal or left-padded, runs as one
kernel a layer instead (wide_kernel.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from . import kv_attention, rows_gemv, wide_kernel

__all__ = ["unfused_attention", "use_kernel", "wide_attention"]

_fused = mx.fast.scaled_dot_product_attention
_kernel = {"on": False}  # wide_kernel.py for the causal attention it supports


def use_kernel(on: bool) -> None:
    """Route verification attention that wide_kernel.py supports through it."""
    _kernel["on"] = on


def _bias(mask, B: int, Hkv: int, rep: int, L: int, S: int):
    """The mask as an additive float32 bias broadcasting to [B, Hkv, rep, L, S]."""
    if isinstance(mask, str):  # "causal": query i sees keys up to S - L + i
        allowed = mx.arange(S)[None] <= (mx.arange(L) + (S - L))[:, None]  # [L, S]
    else:
        allowed = mask
        if allowed.ndim == 4:  # [B|1, Hq|1, L, S] -> grouped like the scores
            allowed = (allowed.reshape(allowed.shape[0], -1, 1, L, S)
                       if allowed.shape[1] == 1
                       else allowed.reshape(allowed.shape[0], Hkv, rep, L, S))
        if allowed.dtype != mx.bool_:
            return allowed.astype(mx.float32)
    return mx.where(allowed, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))


def unfused_attention(q, k, v, scale: float, mask=None, bias=None) -> mx.array:
    """q [B, Hq, L, D], k and v [B, Hkv, S, D] (Hq a multiple of Hkv), mask None,
    "causal" (query i sees keys up to S - L + i) or an array broadcasting to
    [B, Hq, L, S] (bool: True = attend; else added to the scores) -> [B, Hq, L, D].
    `bias`: the mask as `_bias` makes it, if already made."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qg = (q * scale).reshape(B, Hkv, rep, L, D)  # query heads grouped by their KV head
    scores = (qg @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # [B, Hkv, rep, L, S]
    if bias is None and mask is not None:
        bias = _bias(mask, B, Hkv, rep, L, S)
    if bias is not None:
        scores = scores + bias
    p = mx.softmax(scores, axis=-1).astype(q.dtype)
    return (p @ v[:, :, None]).reshape(B, Hq, L, D)


_made: dict = {}  # within one forward: (mask's id, shape) -> its bias, made once


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if q.shape[2] < 2 or q.dtype == mx.float32 or sinks is not None or kw:
        return _fused(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
    if _kernel["on"] and kv_attention.wide_supports(q.shape, k, mask, scale):
        return wide_kernel.dense_wide(q, k, v, scale, mask)
    bias = None
    if mask is not None:  # every layer gets the same mask: one bias for them all
        B, Hq, L, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        key = (mask if isinstance(mask, str) else id(mask), B, Hkv, L, S)
        bias = _made.get(key)
        if bias is None:
            bias = _made[key] = _bias(mask, B, Hkv, Hq // Hkv, L, S)
    return unfused_attention(q, k, v, scale, bias=bias)


@contextmanager
def wide_attention():
    """While a verification forward is built (on the worker thread, which alone
    builds MLX graphs): attention through `_sdpa`, and few-row products through
    rows_gemv.py's kernel where it is on for verifications."""
    mx.fast.scaled_dot_product_attention = _sdpa
    try:
        with rows_gemv.verifying():
            yield
    finally:
        mx.fast.scaled_dot_product_attention = _fused
        _made.clear()  # (also drops the masks whose ids keyed it)
