"""Single-token attention (decode) in one fused kernel per layer: over a quantized KV
cache without dequantizing it, and over a full-precision one when rows are padded.

mlx-lm reads a quantized cache through `mx.quantized_matmul` (scores, then values).
MLX's CUDA backend has no quantized matmul for those shapes, so without this module a
CUDA decode step dequantizes every layer's whole cache to full precision and runs plain
attention over the copy: more bytes moved than a full-precision cache would have cost
(0.5-0.6x of its decode rate on an H200). Here one CUDA kernel per layer reads the
mx.quantize triplets (packed uint32 words, scales, biases), dequantizes in registers and
runs an online softmax: the cache is read once, in its quantized size.

Where it runs: only MLX's CUDA backend (`mx.fast.cuda_kernel`), only for decode (one
query token per row), bits 2/4/8. Metal and the CPU keep mlx-lm's quantized matmuls;
prefill chunks read their cache dequantized. `reference` is the same math in MLX ops
(what the CPU tests check against mlx-lm), and `self_check` compares the kernel with
dequantize-then-attend on the device at load before the engine uses it.

Full precision: MLX's CUDA attention with a mask array (a left-padded batch) was 4-13x
slower than without at Llama-1B's shapes on an H200 (2.0 ms vs 0.15 ms a layer at
batch 128); the same kernel reading bf16 keys costs about the same with or without.
A padded batch's LeanBatchKVCache hands decode attention a `DenseKV` when
`dense_decode` is on (CUDA, after `self_check_dense`); unpadded batches keep MLX's.

The hook: a cache hands attention a `FusedKV` triplet or a `DenseKV` (tuples, so
mlx-lm's code passes them through unchanged) and says it has `bits`, so mlx-lm's
`scaled_dot_product_attention` sends them to
`mlx_lm.models.base.quantized_scaled_dot_product_attention`, which `install()` wraps:
these go to the kernels, anything else to mlx-lm's own function. kv_kernels.py and
kv_onekey.py hold the CUDA source.
"""

from __future__ import annotations

import math
from typing import List, Optional

import mlx.core as mx

from . import kv_kernels, kv_onekey, wide_kernel

__all__ = ["FusedKV", "DenseKV", "decode_attention", "dense_attention", "reference",
           "kernel_supports", "dense_supports", "install", "self_check",
           "self_check_dense", "self_check_wide", "wide_supports", "cuda_backend"]


class FusedKV(tuple):
    """A quantized cache's (packed, scales, biases) for one layer's decode attention:
    packed [B, Hkv, S, D*bits/32] uint32, scales and biases [B, Hkv, S, D/group]."""

    __slots__ = ()


class DenseKV(tuple):
    """(keys,) or (values,) [B, Hkv, S, D] of a full-precision cache, for one layer's
    decode attention over a padded batch."""

    __slots__ = ()


# the quantized kernel self_check picked: one key per lane group and step (measured
# 1.5-2.4x faster on an H200 than reading 4 ahead, which costs registers), else that
_QUANT = [kv_onekey.quantized]


def cuda_backend() -> bool:
    """Does MLX run on its CUDA backend here?"""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except Exception:
        return False


def kernel_supports(queries_shape, keys: FusedKV, group_size: int, bits: int,
                    mask, scale: float = 1.0) -> bool:
    """Shapes and masks the kernel takes (else the caller dequantizes)."""
    B, Hq, L, D = queries_shape
    Hkv, S = keys[0].shape[1], keys[0].shape[2]
    if L != 1 or bits not in (2, 4, 8) or D % group_size or Hq % Hkv or S == 0 \
            or not scale > 0:
        return False
    if group_size * bits < 32 or (D * bits) % 32 or D > 256:
        return False
    if mask is not None and not _mask_ok(mask, B, S):
        return False
    return True


def dense_supports(queries_shape, keys, mask, scale: float = 1.0) -> bool:
    """Shapes, dtypes and masks the dense kernel takes (else MLX's attention)."""
    B, Hq, L, D = queries_shape
    Hkv, S = keys.shape[1], keys.shape[2]
    # (larger heads would not fit a lane's registers)
    return (L == 1 and Hq % Hkv == 0 and S > 0 and scale > 0 and D <= 256 and D % 4 == 0
            and keys.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and (mask is None or _mask_ok(mask, B, S)))


def wide_supports(queries_shape, keys, mask, scale: float = 1.0) -> bool:
    """A verification's attention that wide_kernel.py takes: 2 to MAX_POSITIONS
    query positions, the "causal" mask (a row alone or an unpadded batch) or a
    boolean one per row and position over the keys, [B, 1, W, S] (a left-padded
    batch's; sliding windows' masks are of this kind too)."""
    B, Hq, L, D = queries_shape
    S = keys.shape[2]
    if isinstance(mask, str):
        mask_ok = mask == "causal"
    else:
        mask_ok = (isinstance(mask, mx.array) and mask.dtype == mx.bool_
                   and tuple(mask.shape) == (B, 1, L, S))
    return (mask_ok and 2 <= L <= wide_kernel.MAX_POSITIONS and L <= S
            and Hq % keys.shape[1] == 0 and scale > 0
            and D <= 256 and D % 4 == 0
            and keys.dtype in (mx.bfloat16, mx.float16, mx.float32))


def _mask_ok(mask, B, S) -> bool:
    # a boolean mask over keys, the same for every head (left padding): [B|1, 1, 1, S]
    return (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4
            and mask.shape[0] in (1, B) and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[3] == S)


# -- the same math in MLX ops -------------------------------------------------------------
def _unpack(trip, group_size: int, bits: int) -> mx.array:
    """Dequantize a triplet the kernel's way: value i of a word is bits i*b..i*b+b-1,
    then scale * value + bias per group (float32)."""
    w, scales, biases = trip
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    vals = (w[..., None] >> shifts) & mx.array((1 << bits) - 1, mx.uint32)
    vals = vals.reshape(*w.shape[:-1], -1).astype(mx.float32)  # [..., S, D]
    D = vals.shape[-1]
    g = vals.reshape(*vals.shape[:-1], D // group_size, group_size)
    x = g * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return x.reshape(vals.shape)


def reference(queries, keys, values, scale, mask, group_size: int, bits: int,
              groups: int = 4) -> mx.array:
    """The kernel's math in MLX ops: float32 dot products against the unpacked keys,
    keys split into `groups` interleaved sets (key s in set s % groups) with an online
    softmax each, then the sets combined by their maxima. queries [B, Hq, 1, D]."""
    B, Hq, L, D = queries.shape
    Hkv, S = keys[0].shape[1], keys[0].shape[2]
    n_rep = Hq // Hkv
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, n_rep, L, D)
    k = _unpack(keys, group_size, bits)[:, :, None]  # [B, Hkv, 1, S, D]
    v = _unpack(values, group_size, bits)[:, :, None]
    s = q @ k.swapaxes(-1, -2)  # [B, Hkv, n_rep, L, S]
    valid = mx.ones((1, 1, 1, 1, S), mx.bool_)
    if mask is not None:
        valid = mx.broadcast_to(mask, (mask.shape[0], 1, 1, S))[:, :, None]
    neg = mx.array(-math.inf, mx.float32)
    s = mx.where(valid, s, neg)
    which = mx.arange(S) % groups
    ms, ls, os = [], [], []
    for g in range(groups):
        sel = which == g
        sg = mx.where(sel, s, neg)
        m = sg.max(axis=-1, keepdims=True)
        p = mx.where(sel & valid, mx.exp(sg - mx.where(m == -math.inf, 0, m)), 0)
        ms.append(m)
        ls.append(p.sum(axis=-1, keepdims=True))
        os.append(p @ v)
    M = mx.stack(ms).max(axis=0)
    e = [mx.where(m == -math.inf, 0, mx.exp(m - M)) for m in ms]
    lsum = sum(li * ei for li, ei in zip(ls, e))
    o = sum(oi * ei for oi, ei in zip(os, e))
    out = mx.where(lsum > 0, o / mx.where(lsum > 0, lsum, 1), 0)
    return out.reshape(B, Hq, L, D).astype(queries.dtype)


def decode_attention(queries, keys: FusedKV, values: FusedKV, scale: float, mask,
                     group_size: int, bits: int) -> mx.array:
    """Attention of one query token per row over a quantized cache: the fused kernel
    on CUDA, the same math in MLX ops elsewhere. The caller checked kernel_supports."""
    if mask is not None and mask.shape[0] == 1 and queries.shape[0] > 1:
        mask = mx.broadcast_to(mask, (queries.shape[0],) + mask.shape[1:])
    if cuda_backend():
        return _fused_cuda(queries, keys, values, scale, mask, group_size, bits)
    return reference(queries, keys, values, scale, mask, group_size, bits)


def _fused_cuda(queries, keys, values, scale, mask, group_size, bits):
    return _QUANT[0](queries, keys, values, scale, mask, group_size, bits)


def dense_attention(queries, keys, values, scale: float, mask) -> mx.array:
    """Attention of one query token per row over full-precision keys and values
    [B, Hkv, S, D]: the kernel on CUDA, MLX's attention elsewhere."""
    if mask is not None and mask.shape[0] == 1 and queries.shape[0] > 1:
        mask = mx.broadcast_to(mask, (queries.shape[0],) + mask.shape[1:])
    if cuda_backend():
        return _dense_cuda(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                mask=mask)


def _dense_cuda(queries, keys, values, scale, mask):
    return kv_kernels.dense(queries, keys, values, scale, mask)


def dequantized_attention(queries, keys, values, scale, mask, group_size, bits):
    """The fallback: dequantize the whole cache, then MLX's attention."""
    k = mx.dequantize(*keys, group_size=group_size, bits=bits)
    v = mx.dequantize(*values, group_size=group_size, bits=bits)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


# -- the hook into mlx-lm -------------------------------------------------------------------
_seen: Optional[List[tuple]] = None  # while recording: each call's shapes (self_check)
_seen_dense: Optional[List[tuple]] = None  # the same for DenseKV calls


def install() -> None:
    """Wrap mlx-lm's quantized attention so FusedKV triplets reach decode_attention
    (idempotent; anything else still goes to mlx-lm's own function)."""
    from mlx_lm.models import base
    orig = base.quantized_scaled_dot_product_attention
    if getattr(orig, "_mlxnb_fused", False):
        return

    def quantized_sdpa(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        if isinstance(q_keys, DenseKV):
            return _dense(queries, q_keys[0], q_values[0], scale, mask)
        if not isinstance(q_keys, FusedKV):
            return orig(queries, q_keys, q_values, scale, mask, group_size, bits)
        if isinstance(mask, str):  # "causal" for one query: every key
            mask = None
        if _seen is not None:
            _seen.append((queries.shape[1], q_keys[0].shape[1], queries.shape[3],
                          queries.dtype, q_keys[1].dtype, float(scale), group_size, bits))
        if kernel_supports(queries.shape, q_keys, group_size, bits, mask, scale):
            return decode_attention(queries, q_keys, q_values, scale, mask, group_size, bits)
        return dequantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits)

    quantized_sdpa._mlxnb_fused = True
    base.quantized_scaled_dot_product_attention = quantized_sdpa


def _dense(queries, keys, values, scale, mask):
    if isinstance(mask, str):
        mask = None
    if _seen_dense is not None:
        _seen_dense.append((queries.shape[1], keys.shape[1], queries.shape[3],
                            queries.dtype, keys.dtype, float(scale)))
    # only a padded batch's masked attention is slow in MLX (module docstring): with
    # no mask its own kernel runs, and the load check compiles one kernel, not two
    if mask is not None and dense_supports(queries.shape, keys, mask, scale):
        return dense_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                mask=mask)


class recording:
    """`with recording() as calls:` collects the shapes of the fused calls a probe
    forward makes: (Hq, Hkv, D, query dtype, scales dtype, scale, group, bits);
    `recording(dense=True)`: of the DenseKV calls, (Hq, Hkv, D, query dtype, keys
    dtype, scale)."""

    def __init__(self, dense: bool = False):
        self.dense = dense

    def __enter__(self):
        global _seen, _seen_dense
        if self.dense:
            _seen_dense = []
            return _seen_dense
        _seen = []
        return _seen

    def __exit__(self, *exc):
        global _seen, _seen_dense
        if self.dense:
            _seen_dense = None
        else:
            _seen = None


def self_check(calls: List[tuple], S: int = 300, B: int = 3, seed: int = 0) -> Optional[str]:
    """Run decode_attention against dequantize-then-attend on this device at each
    recorded shape, with and without a left-padding mask, with the one-key kernel
    and, if that fails, the unrolled one (kept for what follows). None if one
    matches in every case; else what went wrong with the first (one line)."""
    first = None
    for impl in (kv_onekey.quantized, kv_kernels.quantized):
        _QUANT[0] = impl
        why = _check_quantized(calls, S, B, seed)
        if why is None:
            return None
        first = first or why
    _QUANT[0] = kv_onekey.quantized
    return first


def _check_quantized(calls, S, B, seed) -> Optional[str]:
    key = mx.random.key(seed)
    for Hq, Hkv, D, qdt, sdt, scale, gs, bits in sorted(set(calls), key=str):
        try:
            k1, k2, k3, key = mx.random.split(key, 4)
            q = mx.random.normal((B, Hq, 1, D), key=k1).astype(qdt)
            k = mx.random.normal((B, Hkv, S, D), key=k2).astype(sdt)
            v = mx.random.normal((B, Hkv, S, D), key=k3).astype(sdt)
            kq = FusedKV(mx.quantize(k, group_size=gs, bits=bits))
            vq = FusedKV(mx.quantize(v, group_size=gs, bits=bits))
            pad = mx.array([0, 7, S - 5][:B] + [0] * max(0, B - 3))
            masks = [None, (pad[:, None, None, None] <= mx.arange(S))]
            for mask in masks:
                if not kernel_supports(q.shape, kq, gs, bits, mask, scale):
                    return f"no kernel for shape Hq={Hq} Hkv={Hkv} D={D} bits={bits}"
                got = decode_attention(q, kq, vq, scale, mask, gs, bits).astype(mx.float32)
                want = dequantized_attention(q, kq, vq, scale, mask, gs, bits)
                want = want.astype(mx.float32)
                err = (got - want).abs().max().item()
                tol = 0.02 + 0.02 * want.abs().max().item()
                if not err <= tol:  # also catches NaN
                    return (f"fused kernel differs from dequantized attention by {err:.3g} "
                            f"(Hq={Hq} Hkv={Hkv} D={D} bits={bits} group={gs}"
                            f"{' masked' if mask is not None else ''})")
        except Exception as e:
            return f"fused kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


def self_check_dense(calls: List[tuple], S: int = 300, B: int = 3,
                     seed: int = 1) -> Optional[str]:
    """dense_attention against MLX's attention on this device at each recorded shape,
    with a left-padding mask (the only calls the kernel gets): None if every case
    matches, else what went wrong (one line)."""
    key = mx.random.key(seed)
    for Hq, Hkv, D, qdt, kdt, scale in sorted(set(calls), key=str):
        try:
            k1, k2, k3, key = mx.random.split(key, 4)
            q = mx.random.normal((B, Hq, 1, D), key=k1).astype(qdt)
            # keys as a cache holds them: a view of the first S positions of a buffer
            k = mx.random.normal((B, Hkv, S + 40, D), key=k2).astype(kdt)[..., :S, :]
            v = mx.random.normal((B, Hkv, S + 40, D), key=k3).astype(kdt)[..., :S, :]
            pad = mx.array([0, 7, S - 5][:B] + [0] * max(0, B - 3))
            mask = pad[:, None, None, None] <= mx.arange(S)
            if not dense_supports(q.shape, k, mask, scale):
                return f"no dense kernel for shape Hq={Hq} Hkv={Hkv} D={D}"
            got = dense_attention(q, k, v, scale, mask).astype(mx.float32)
            want = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=scale, mask=mask).astype(mx.float32)
            err = (got - want).abs().max().item()
            if not err <= 0.02 + 0.02 * want.abs().max().item():
                return (f"dense kernel differs from MLX's attention by {err:.3g} "
                        f"(Hq={Hq} Hkv={Hkv} D={D} masked)")
        except Exception as e:
            return f"dense kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


# every capacity of wide_kernel.py, full and part-full: the check compiles and loads
# each kernel a verification can reach, at load rather than mid-run
WIDE_CHECK_WIDTHS = (2, 3, 5, 9, 16)


def self_check_wide(calls: List[tuple], S: int = 300, B: int = 2,
                    seed: int = 2) -> Optional[str]:
    """wide_kernel.dense_wide against the composed attention (wideattn.py) on this
    device at each recorded shape (`recording(dense=True)`'s tuples), for each of
    WIDE_CHECK_WIDTHS, causal and with a left-padded batch's mask: None if every
    case matches, else what went wrong."""
    from .wideattn import unfused_attention

    key = mx.random.key(seed)
    keys_at = mx.arange(S)[None, None, None]  # [1, 1, 1, S]
    unpadded = keys_at >= mx.arange(B)[:, None, None, None] * 37  # row b: 37 * b pads
    for Hq, Hkv, D, qdt, kdt, scale in sorted(set(calls), key=str):
        for W in WIDE_CHECK_WIDTHS:
            padded = unpadded & (keys_at <= (mx.arange(W) + S - W)[None, None, :, None])
            for mask in ("causal", padded):
                try:
                    k1, k2, k3, key = mx.random.split(key, 4)
                    # queries as attention gets them: [B, W, Hq, D] transposed (strided)
                    q = mx.random.normal((B, W, Hq, D), key=k1).astype(qdt).transpose(0, 2, 1, 3)
                    k = mx.random.normal((B, Hkv, S + 40, D), key=k2).astype(kdt)[..., :S, :]
                    v = mx.random.normal((B, Hkv, S + 40, D), key=k3).astype(kdt)[..., :S, :]
                    if not wide_supports(q.shape, k, mask, scale):
                        return f"no wide kernel for shape Hq={Hq} Hkv={Hkv} D={D} W={W}"
                    got = wide_kernel.dense_wide(q, k, v, scale, mask).astype(mx.float32)
                    want = unfused_attention(q, k, v, scale, mask).astype(mx.float32)
                    err = (got - want).abs().max().item()
                    if not err <= 0.02 + 0.02 * want.abs().max().item():
                        how = "causal" if isinstance(mask, str) else "padded"
                        return (f"wide kernel differs from the composed attention by "
                                f"{err:.3g} (Hq={Hq} Hkv={Hkv} D={D} W={W}, {how})")
                except Exception as e:
                    return (f"wide kernel failed: {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]}")
    return None
