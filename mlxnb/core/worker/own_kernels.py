"""This package's CUDA kernels at the model's sizes, compiled ahead while helper
processes compile the model's kernels (kernels_ahead.py).

MLX compiles a kernel made with `mx.fast.cuda_kernel` in the process that first runs
it (kernel_files.py), so on a fresh machine each load check that first runs one
waited for NVRTC: 2-4 s for the padded decode attention, 3-7 s for a short conv, 1-2 s
for the one-token q/k norms and RoPE (bench/results/first-token-2026-12-06-h100.md),
and more for a delta-net's prefill and decode kernels (gated_delta_prefill.py).
Meanwhile the process only waited for its helpers. `warm` runs each kernel those
checks will run, on zeros at the sizes each layer gives it (the template arguments
MLX names a kernel by): the checks then find them compiled. A guess
that misses costs its compile and nothing else; the checks still decide what runs.
They compile at once, each in a helper process of its own (kernel_files.write_now),
and the process loads them from MLX's folder: one after another in the process they took
14 s of a Qwen3.5 load on a fresh H100 host.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..._log import log, swallowed
from . import gated_delta_prefill, kernel_files, kv_attention, qk_rope, short_conv
from .kernels_ahead import model_dtype

__all__ = ["warm"]

_HEADS = (("n_heads", "n_kv_heads"), ("num_attention_heads", "num_key_value_heads"))


def _attention(m) -> Optional[tuple]:
    """(key, call): the padded decode attention of an mlx-lm attention module, as
    kv_attention.self_check_dense runs it, on zeros; None for other modules."""
    heads = next(((getattr(m, a), getattr(m, b)) for a, b in _HEADS
                  if hasattr(m, a) and hasattr(m, b)), None)
    scale, dt = getattr(m, "scale", None), model_dtype(m)
    if heads is None or not isinstance(scale, float) or dt is None:
        return None
    dt = getattr(mx, dt)
    (Hq, Hkv), S = heads, 64
    D = getattr(m, "head_dim", None)
    wq = getattr(getattr(m, "q_proj", None), "weight", None)  # (quantized too: [out, .])
    if not isinstance(D, int) and isinstance(wq, mx.array):
        D = wq.shape[0] // Hq  # (no head_dim kept: q_proj gives the heads alone)
    if not isinstance(D, int):
        return None
    q = mx.zeros((1, Hq, 1, D), dt)
    k = mx.zeros((1, Hkv, S + 8, D), dt)[..., :S, :]  # a view of a cache's buffer
    mask = mx.zeros((1, 1, 1, S), mx.bool_)
    if not kv_attention.dense_supports(q.shape, k, mask, scale):
        return None
    return (Hq, Hkv, D, dt, scale), partial(kv_attention.dense_attention, q, k, k, scale, mask)


def _qk(m) -> Optional[tuple]:
    """(key, call): qk_rope.py's kernel as its self-check runs it, on zeros."""
    form = qk_rope._form(m)
    if form is None:
        return None
    qn, kn = (m[n] for n in form.norms)
    H, HK = (getattr(m, n) for n in form.heads)
    D, rope, dt = qn.weight.shape[0], m.rope, qn.weight.dtype
    q, k = mx.zeros((1, 1, H, D), dt), mx.zeros((1, 1, HK, D), dt)
    return (H, HK, D, rope.dims, form.plus_one, dt), partial(
        qk_rope.norm_rope, q, k, qn.weight, kn.weight, qn.eps, kn.eps, 0, rope.scale,
        rope.base, rope.dims, form.plus_one)


def _conv(m) -> Optional[tuple]:
    """(key, call): a short conv's one-token kernel (short_conv.py), on zeros."""
    kind = short_conv._kind(m)
    if kind is None:
        return None
    w = (m.conv if kind == "gated" else m.conv1d).weight  # [C, L, 1]
    C, L = w.shape[0], w.shape[1]
    x = mx.zeros((1, 1, 3 * C if kind == "gated" else C), w.dtype)
    state = mx.zeros((1, L - 1, C), w.dtype)
    step = short_conv.gated_step if kind == "gated" else short_conv.silu_step
    return (kind, C, L, w.dtype), partial(step, x, state, w)


def _delta(m) -> Optional[tuple]:
    """(key, call): a delta-net's prefill and decode kernels (gated_delta_prefill.py)."""
    return gated_delta_prefill.warm_call(m)


def calls(model, kv_bits: Optional[int] = None) -> Dict[tuple, Callable]:
    """{(finder, what names the kernel): a call}, one per kernel and template the
    load's checks will run."""
    finders = [_qk, _delta] + ([_conv] if short_conv.wanted() else [])
    finders += [_attention] if kv_bits is None else []  # (quantized KV: another kernel)
    found = {}
    for _, m in model.named_modules():
        for find in finders:
            try:
                got = find(m)
            except Exception:  # (a module of another shape: not this kernel's)
                got = None
            if got is not None:
                found.setdefault((find.__name__,) + got[0], got[1])
    return found


def warm(model, kv_bits: Optional[int] = None) -> int:
    """Compile (run on zeros) this package's kernels at the model's sizes, where MLX
    runs on CUDA; returns how many calls ran. The calls are made first, unevaluated,
    so kernel_files.py notes each build and compiles them all at once in a helper;
    evaluating them then loads each from MLX's folder."""
    if not kv_attention.cuda_backend():
        return 0
    t0, n, outs = time.perf_counter(), 0, []
    for call in calls(model, kv_bits).values():
        try:
            outs.append(call())
        except Exception:
            swallowed("compiling this package's kernels ahead")
    written = kernel_files.write_now()
    for out in outs:
        try:
            mx.eval(out)
            n += 1
        except Exception:
            swallowed("compiling this package's kernels ahead")
    log.info("own kernels compiled in %.1f s (%d calls, %d builds in helpers)",
             time.perf_counter() - t0, n, written)
    return n
