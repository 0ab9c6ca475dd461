"""An attention layer's q/k norms and RoPE for one decode token in one CUDA kernel.

mlx-lm's LFM2 attention decodes a token with six launches between its projections and
the KV write: q and k are slices of the fused projection, so each `rms_norm` first
copies its input to make it contiguous (mlx/backend/cuda/rms_norm.cu), then the two
norms, then RoPE on each. A decode step is host-bound on GPUs at these sizes, and
MLX's CUDA backend costs the host about the same per launch whatever the kernel does,
so here the six are one kernel: a warp owns one head of one row, reads it once through
its strides, normalizes it (mx.fast.rms_norm's float32 sum and roundings), rotates it
(mx.fast.rope's angles) and writes it in the [B, heads, 1, D] layout the cache takes.
LFM2-1.2B has six attention layers: 30 launches fewer a step.

`adopt` gives a model's matching attention modules a subclass (on this instance) whose
one-token calls take the kernel while `enabled()` allows it (the engine's gate: the
load check's switch); everything else -- prefill chunks, verifications, other
callers -- runs mlx-lm's code. setup.py compares decode steps with and without it at
load and puts the modules back if they differ. The one-token call is mlx-lm's
`Attention.__call__` (mlx_lm/models/lfm2.py) with the norms and RoPE swapped
(`_token`).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .recurrent import Gated

__all__ = ["adopt", "release", "norm_rope", "wanted", "SEEN"]

SEEN = [0]  # one-token attention calls that took the kernel (a probe reads it)

# q: [B, 1, H, D], k: [B, 1, HK, D], read through their strides; qw, kw: the norms'
# weights [D]; offset: int32 [B] (PER_ROW) or [1]; consts: q's eps, k's eps, RoPE's
# scale, log2(base). qo: [B, H, 1, D], ko: [B, HK, 1, D]. Warp n of row b: q's head
# n, or k's head n - H. Lane i holds the rotation pairs (j, j + D/2), j = i, i + 32..
_BODY = r"""
    constexpr int HALF = D / 2;
    constexpr int NP = (HALF + 31) / 32;
    const int lane = threadIdx.x;
    const int n = blockIdx.y;
    const int b = blockIdx.z;
    const bool isq = n < H;
    const int h = isq ? n : n - H;
    const InT* src = isq ? q : k;
    const int64_t s0 = isq ? q_strides[0] : k_strides[0];
    const int64_t s2 = isq ? q_strides[2] : k_strides[2];
    const int64_t s3 = isq ? q_strides[3] : k_strides[3];
    const InT* w = isq ? qw : kw;
    const float eps = consts[isq ? 0 : 1];
    const int64_t base = b * s0 + h * s2;
    float x1[NP], x2[NP];
    float ss = 0.f;
    for (int p = 0; p < NP; p++) {
        const int j = lane + 32 * p;
        x1[p] = j < HALF ? static_cast<float>(src[base + j * s3]) : 0.f;
        x2[p] = j < HALF ? static_cast<float>(src[base + (j + HALF) * s3]) : 0.f;
        ss += x1[p] * x1[p] + x2[p] * x2[p];
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = rsqrtf(ss / D + eps);
    const float pos = consts[2] * static_cast<float>(offset[PER_ROW ? b : 0]);
    InT* dst = isq ? qo + (static_cast<int64_t>(b) * H + h) * D
                   : ko + (static_cast<int64_t>(b) * HK + h) * D;
    for (int p = 0; p < NP; p++) {
        const int j = lane + 32 * p;
        if (j >= HALF) break;
        // rms_norm: w * round(x * r); RoPE on the rounded result
        const float a = static_cast<float>(static_cast<InT>(
            static_cast<float>(w[j]) * static_cast<float>(static_cast<InT>(x1[p] * r))));
        const float c = static_cast<float>(static_cast<InT>(
            static_cast<float>(w[j + HALF])
            * static_cast<float>(static_cast<InT>(x2[p] * r))));
        const float theta = pos * exp2f(-(static_cast<float>(j) / HALF) * consts[3]);
        const float ct = cos(theta), st = sin(theta);
        dst[j] = static_cast<InT>(a * ct - c * st);
        dst[j + HALF] = static_cast<InT>(a * st + c * ct);
    }
"""

_KERNEL = []
_CONSTS = {}


def _kernel():
    if not _KERNEL:
        _KERNEL.append(mx.fast.cuda_kernel(
            name="mlxnb_qk_norm_rope", input_names=["q", "k", "qw", "kw", "offset", "consts"],
            output_names=["qo", "ko"], source=_BODY, ensure_row_contiguous=False))
    return _KERNEL[0]


def norm_rope(q, k, qw, kw, q_eps: float, k_eps: float, offset, scale: float,
              base: float):
    """RMS-normalized and rotated q [B, 1, H, D] and k [B, 1, HK, D] ->
    ([B, H, 1, D], [B, HK, 1, D]); `offset` an int, or int32 positions [1] or [B]."""
    B, _, H, D = q.shape
    HK = k.shape[2]
    off = mx.array([offset], mx.int32) if isinstance(offset, int) else \
        offset.reshape(-1).astype(mx.int32)
    key = (q_eps, k_eps, scale, base)
    consts = _CONSTS.get(key)
    if consts is None:  # (one per layer kind, not one per call)
        consts = _CONSTS[key] = mx.array([q_eps, k_eps, scale, math.log2(base)],
                                         mx.float32)
    return _kernel()(
        inputs=[q, k, qw, kw, off, consts],
        template=[("InT", q.dtype), ("D", D), ("H", H), ("HK", HK),
                  ("PER_ROW", off.size > 1)],
        grid=(32, H + HK, B), threadgroup=(32, 1, 1),
        output_shapes=[(B, H, 1, D), (B, HK, 1, D)], output_dtypes=[q.dtype, q.dtype])


def wanted() -> bool:
    """On CUDA, unless `MLXNB_QK_ROPE=0` keeps mlx-lm's norms and RoPE (a bench's other
    arm)."""
    from .kv_attention import cuda_backend

    return cuda_backend() and os.environ.get("MLXNB_QK_ROPE", "1") != "0"


def _matches(m) -> bool:
    """mlx-lm's LFM2 Attention as the kernel reads it: RMS norms on q and k, a plain
    RoPE over the whole head (nn.RoPE, not traditional)."""
    if not (isinstance(m, nn.Module) and type(m).__name__ == "Attention"
            and not hasattr(type(m), "_mlxnb_qk_base")):
        return False
    mod = sys.modules.get(type(m).__module__)
    need = ("q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm", "k_layernorm",
            "rope", "n_heads", "n_kv_heads", "head_dim", "scale")
    if not (hasattr(mod, "scaled_dot_product_attention")
            and all(hasattr(m, a) for a in need)):
        return False
    rope, qn, kn = m.rope, m.q_layernorm, m.k_layernorm
    return (type(rope) is nn.RoPE and not rope.traditional and rope.dims == m.head_dim
            and type(qn) is nn.RMSNorm and type(kn) is nn.RMSNorm
            and m.head_dim % 2 == 0 and m.head_dim <= 512)


def _offset(cache, B):
    off = getattr(cache, "offset", None)
    if isinstance(off, int):
        return off
    if isinstance(off, mx.array) and off.size in (1, B) and mx.issubdtype(off.dtype,
                                                                           mx.integer):
        return off
    return None


def _token(self, x, mask, cache):
    """mlx-lm's LFM2 Attention.__call__ for one token, its norms and RoPE as
    norm_rope; None where the kernel does not fit."""
    B = x.shape[0]
    off = _offset(cache, B)
    if off is None:
        return None
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if not (q.dtype == k.dtype == self.q_layernorm.weight.dtype
            == self.k_layernorm.weight.dtype):
        return None
    SEEN[0] += 1
    queries, keys = norm_rope(
        q.reshape(B, 1, self.n_heads, -1), k.reshape(B, 1, self.n_kv_heads, -1),
        self.q_layernorm.weight, self.k_layernorm.weight, self.q_layernorm.eps,
        self.k_layernorm.eps, off, self.rope.scale, self.rope.base)
    values = v.reshape(B, 1, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys, values = cache.update_and_fetch(keys, values)
    sdpa = sys.modules[type(self)._mlxnb_qk_base.__module__].scaled_dot_product_attention
    out = sdpa(queries, keys, values, cache=cache, mask=mask, scale=self.scale)
    return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, 1, -1))


_SUBCLASSES = {}


def _subclass(cls):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        def __call__(self, x, mask=None, cache=None):
            if cache is not None and x.shape[1] == 1 and self._mlxnb_qk_gate.allowed():
                y = _token(self, x, mask, cache)
                if y is not None:
                    return y
            return cls.__call__(self, x, mask=mask, cache=cache)

        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__doc__": cls.__doc__,
            "_mlxnb_qk_base": cls})
    return sub


def adopt(model, enabled: Callable[[], bool]) -> int:
    """Give every matching attention module of `model.layers` the kernel path while
    every engine's `enabled()` allows it (held weakly, as recurrent.py's gates); how
    many."""
    if not wanted():
        return 0
    n = 0
    for layer in getattr(model, "layers", None) or []:
        if not isinstance(layer, nn.Module):
            continue
        for child in layer.children().values():
            if hasattr(type(child), "_mlxnb_qk_base"):  # adopted for another engine
                child._mlxnb_qk_gate.add_gate(enabled)
                n += 1
            elif _matches(child):
                child._mlxnb_qk_gate = Gated(enabled)
                child.__class__ = _subclass(type(child))
                n += 1
    return n


def release(model) -> None:
    """Put every adopted attention module back to mlx-lm's class."""
    for layer in getattr(model, "layers", None) or []:
        if not isinstance(layer, nn.Module):
            continue
        for child in layer.children().values():
            base = getattr(type(child), "_mlxnb_qk_base", None)
            if base is not None:
                child.__class__ = base
                del child._mlxnb_qk_gate
