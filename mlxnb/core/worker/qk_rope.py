"""An attention layer's q/k norms and RoPE for one decode token in one CUDA kernel.

mlx-lm's attention with per-head q/k norms (LFM2, Qwen3, Qwen3-Next, Qwen3.5, Gemma 3)
decodes a token with six launches between its projections and the KV write: q and k
are slices of the fused projection, so each `rms_norm` first copies its input to make
it contiguous (mlx/backend/cuda/rms_norm.cu), then the two norms, then RoPE on each. A
decode step is host-bound on GPUs at these sizes, and MLX's CUDA backend costs the
host about the same per launch whatever the kernel does, so here the six are one
kernel: a warp owns one head of one row, reads it once through its strides,
normalizes it (mx.fast.rms_norm's float32 sum and roundings), rotates its first
`dims` (mx.fast.rope's angles) and writes it in the [B, heads, 1, D] layout the cache
takes. LFM2-1.2B and Qwen3.5-0.8B have six such layers each: 30 launches fewer a
step; Qwen3-0.6B has 28, Gemma-3-1B 26.

`adopt` gives a model's matching attention modules (`FORMS`) a subclass (on this
instance) whose one-token calls take the kernel while every engine's gate allows it
(the load check's switch); everything else -- prefill chunks, verifications, other
callers -- runs mlx-lm's code. At load setup.py compares the kernel with MLX's norms
and RoPE at each layer's sizes (`self_check`: one position for all rows, and one per
row) and decode steps with and without it, and puts the modules back if either
differs. The one-token call is the module's mlx-lm `__call__` with the norms and
RoPE swapped (`_token`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from . import kernel_files
from .recurrent import Gated

__all__ = ["adopt", "release", "norm_rope", "self_check", "wanted"]

# q: [B, 1, H, D], k: [B, 1, HK, D], read through their strides; qw, kw: the norms'
# weights [D]; offset: int32 [B] (a position per row) or [1]; consts: q's eps, k's eps, RoPE's
# scale, log2(base). qo: [B, H, 1, D], ko: [B, HK, 1, D]. Warp n of row b: q's head
# n, or k's head n - H. The first ROT dims rotate in pairs (j, j + ROT/2) and the rest
# pass (mx.fast.rope with dims=ROT); lane i holds pairs j = i, i + 32 .. and rest
# elements ROT + i, ROT + i + 32 ..
_BODY = r"""
    constexpr int HALF = ROT / 2;
    constexpr int NP = (HALF + 31) / 32;
    constexpr int NR = (D - ROT + 31) / 32 > 0 ? (D - ROT + 31) / 32 : 1;
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
    auto scale_of = [](InT v) {
        return PLUS_ONE ? static_cast<float>(static_cast<InT>(1.f + static_cast<float>(v)))
                        : static_cast<float>(v);
    };
    const int64_t base = b * s0 + h * s2;
    float x1[NP], x2[NP], xr[NR];
    float ss = 0.f;
    for (int p = 0; p < NP; p++) {
        const int j = lane + 32 * p;
        x1[p] = j < HALF ? static_cast<float>(src[base + j * s3]) : 0.f;
        x2[p] = j < HALF ? static_cast<float>(src[base + (j + HALF) * s3]) : 0.f;
        ss += x1[p] * x1[p] + x2[p] * x2[p];
    }
    for (int p = 0; p < NR; p++) {
        const int e = ROT + lane + 32 * p;
        xr[p] = e < D ? static_cast<float>(src[base + e * s3]) : 0.f;
        ss += xr[p] * xr[p];
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = rsqrtf(ss / D + eps);
    const int32_t at = offset[offset_shape[0] > 1 ? b : 0];
    const float pos = consts[2] * static_cast<float>(at);
    InT* dst = isq ? qo + (static_cast<int64_t>(b) * H + h) * D
                   : ko + (static_cast<int64_t>(b) * HK + h) * D;
    // rms_norm: w * round(x * r), rounded; RoPE on that. Gemma's norms scale by
    // 1 + w, rounded to InT as MLX's `1.0 + weight` is
    for (int p = 0; p < NP; p++) {
        const int j = lane + 32 * p;
        if (j >= HALF) break;
        const float a = static_cast<float>(static_cast<InT>(
            scale_of(w[j]) * static_cast<float>(static_cast<InT>(x1[p] * r))));
        const float c = static_cast<float>(static_cast<InT>(
            scale_of(w[j + HALF]) * static_cast<float>(static_cast<InT>(x2[p] * r))));
        const float theta = pos * exp2f(-(static_cast<float>(j) / HALF) * consts[3]);
        const float ct = cos(theta), st = sin(theta);
        dst[j] = static_cast<InT>(a * ct - c * st);
        dst[j + HALF] = static_cast<InT>(a * st + c * ct);
    }
    for (int p = 0; p < NR; p++) {
        const int e = ROT + lane + 32 * p;
        if (e >= D) break;
        dst[e] = static_cast<InT>(
            scale_of(w[e]) * static_cast<float>(static_cast<InT>(xr[p] * r)));
    }
"""

_KERNEL = []
_CONSTS = {}
_OFFSET = [None, None]  # the last int position and its array


def _kernel():
    if not _KERNEL:
        _KERNEL.append(kernel_files.cuda_kernel(
            name="mlxnb_qk_norm_rope", input_names=["q", "k", "qw", "kw", "offset", "consts"],
            output_names=["qo", "ko"], source=_BODY, ensure_row_contiguous=False))
    return _KERNEL[0]


def norm_rope(q, k, qw, kw, q_eps: float, k_eps: float, offset, scale: float,
              base: float, dims: int, plus_one: bool = False):
    """RMS-normalized q [B, 1, H, D] and k [B, 1, HK, D] (scaled by the weights, or by 1
    + weights with `plus_one`), their first `dims` rotated -> ([B, H, 1, D],
    [B, HK, 1, D]); `offset` an int, or int32 positions [1] or [B]."""
    B, _, H, D = q.shape
    HK = k.shape[2]
    if isinstance(offset, int):  # every layer of a step has the same: one array
        if _OFFSET[0] != offset:
            _OFFSET[:] = [offset, mx.array([offset], mx.int32)]
        off = _OFFSET[1]
    else:
        off = offset.reshape(-1).astype(mx.int32)
    key = (q_eps, k_eps, scale, base)
    consts = _CONSTS.get(key)
    if consts is None:  # (one per layer kind, not one per call)
        consts = _CONSTS[key] = mx.array([q_eps, k_eps, scale, math.log2(base)],
                                         mx.float32)
    return _kernel()(
        inputs=[q, k, qw, kw, off, consts],
        template=[("InT", q.dtype), ("D", D), ("ROT", dims), ("H", H), ("HK", HK),
                  ("PLUS_ONE", bool(plus_one))],
        grid=(32, H + HK, B), threadgroup=(32, 1, 1),
        output_shapes=[(B, H, 1, D), (B, HK, 1, D)], output_dtypes=[q.dtype, q.dtype])


def _adopted(model):
    for layer in getattr(model, "layers", None) or []:
        if isinstance(layer, nn.Module):
            for child in layer.children().values():
                if hasattr(type(child), "_mlxnb_qk_base"):
                    yield child


def self_check(model) -> str:
    """'' if the kernel gives mlx-lm's norms and RoPE at every adopted module's sizes
    and dtype, with one position for all rows and with one per row (the load's decode
    check sees only the first); else what differs."""
    done = set()
    for m in _adopted(model):
        form = m._mlxnb_qk_form
        qn, kn = (m[n] for n in form.norms)
        H, HK = (getattr(m, n) for n in form.heads)
        D, rope, dt = qn.weight.shape[0], m.rope, qn.weight.dtype
        key = (H, HK, D, rope.dims, rope.base, rope.scale, qn.eps, kn.eps, dt)
        if key in done:
            continue
        done.add(key)
        kq, kk = mx.random.split(mx.random.key(0))
        q = mx.random.normal((3, 1, H, D), key=kq).astype(dt)
        k = mx.random.normal((3, 1, HK, D), key=kk).astype(dt)
        for off in (37, mx.array([0, 5, 3000], mx.int32)):
            try:
                got = norm_rope(q, k, qn.weight, kn.weight, qn.eps, kn.eps, off,
                                rope.scale, rope.base, rope.dims, form.plus_one)
                want = [rope(norm(x).transpose(0, 2, 1, 3), offset=off)
                        for norm, x in ((qn, q), (kn, k))]
                mx.eval(got, want)
            except Exception as e:
                return f"kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
            for g, w in zip(got, want):
                w = w.astype(mx.float32)
                scale = max(1.0, w.abs().max().item())
                if not (g.astype(mx.float32) - w).abs().max().item() <= 0.02 * scale:
                    return "kernel differs from MLX's norms and RoPE"
    return ""


def wanted() -> bool:
    """On CUDA, unless `MLXNB_QK_ROPE=0` keeps mlx-lm's norms and RoPE (a bench's other
    arm)."""
    from .kv_attention import cuda_backend

    return cuda_backend() and os.environ.get("MLXNB_QK_ROPE", "1") != "0"


@dataclass(frozen=True)
class _Form:
    """How an mlx-lm attention module names its parts. (A class, not a tuple: an
    nn.Module keeps a tuple attribute in its tree.)"""
    norms: tuple  # (q's, k's) nn.RMSNorm over one head
    out: str  # the output projection
    heads: tuple  # (query heads, KV heads) attribute names
    gated: bool = False  # q_proj gives each head's query and an output gate (Qwen3-Next)
    plus_one: bool = False  # the norms scale by 1 + weight (Gemma's RMSNorm)


# (module, class) -> form. Each one-token call below is that class's __call__.
FORMS = {
    ("mlx_lm.models.lfm2", "Attention"): _Form(
        ("q_layernorm", "k_layernorm"), "out_proj", ("n_heads", "n_kv_heads"), False),
    ("mlx_lm.models.lfm2_moe", "Attention"): _Form(
        ("q_layernorm", "k_layernorm"), "out_proj", ("n_heads", "n_kv_heads"), False),
    ("mlx_lm.models.qwen3", "Attention"): _Form(
        ("q_norm", "k_norm"), "o_proj", ("n_heads", "n_kv_heads"), False),
    ("mlx_lm.models.qwen3_moe", "Attention"): _Form(
        ("q_norm", "k_norm"), "o_proj", ("n_heads", "n_kv_heads"), False),
    ("mlx_lm.models.qwen3_next", "Qwen3NextAttention"): _Form(
        ("q_norm", "k_norm"), "o_proj", ("num_attention_heads", "num_key_value_heads"),
        gated=True),
    ("mlx_lm.models.gemma3_text", "Attention"): _Form(
        ("q_norm", "k_norm"), "o_proj", ("n_heads", "n_kv_heads"), plus_one=True),
}


def _form(m):
    """The module's form if the kernel reads it: RMS norms over one head on q and k,
    a plain RoPE (nn.RoPE, not traditional) over an even part of the head."""
    if not isinstance(m, nn.Module) or hasattr(type(m), "_mlxnb_qk_base"):
        return None
    form = FORMS.get((type(m).__module__, type(m).__name__))
    mod = sys.modules.get(type(m).__module__)
    if form is None or not hasattr(mod, "scaled_dot_product_attention") or not all(
            hasattr(m, a) for a in (*form.norms, form.out, *form.heads, "q_proj",
                                    "k_proj", "v_proj", "rope", "scale")):
        return None
    qn, kn = (m[n] for n in form.norms)
    rope = m.rope
    # nn.RMSNorm, or the model's own RMSNorm that scales by 1 + weight
    norm = (lambda x: type(x).__name__ == "RMSNorm" and type(x).__module__ ==
            type(m).__module__) if form.plus_one else (lambda x: type(x) is nn.RMSNorm)
    D = qn.weight.shape[0] if norm(qn) and qn.weight.ndim == 1 else 0
    ok = (D > 0 and norm(kn) and kn.weight.shape == (D,)
          and type(rope) is nn.RoPE and not rope.traditional
          and 2 <= rope.dims <= D <= 512 and rope.dims % 2 == 0)
    return form if ok else None


def _offset(cache, B):
    off = getattr(cache, "offset", None)
    if isinstance(off, int):
        return off
    if isinstance(off, mx.array) and off.size in (1, B) and mx.issubdtype(off.dtype,
                                                                           mx.integer):
        return off
    return None


def _token(self, x, mask, cache):
    """The module's __call__ for one token (mlx_lm/models/lfm2.py, qwen3.py,
    qwen3_next.py), its norms and RoPE as norm_rope; None where the kernel does not
    fit."""
    form = self._mlxnb_qk_form
    B = x.shape[0]
    off = _offset(cache, B)
    if off is None:
        return None
    qn, kn = (self[n] for n in form.norms)
    H, HK = (getattr(self, n) for n in form.heads)
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    D = qn.weight.shape[0]
    if not (q.dtype == k.dtype == qn.weight.dtype == kn.weight.dtype
            and q.shape[-1] == H * D * (2 if form.gated else 1) and k.shape[-1] == HK * D):
        return None
    gate = None
    if form.gated:  # each head's query, then its gate
        q, gate = mx.split(q.reshape(B, 1, H, -1), 2, axis=-1)
        gate = gate.reshape(B, 1, -1)
    queries, keys = norm_rope(
        q.reshape(B, 1, H, -1), k.reshape(B, 1, HK, -1), qn.weight, kn.weight, qn.eps,
        kn.eps, off, self.rope.scale, self.rope.base, self.rope.dims, form.plus_one)
    values = v.reshape(B, 1, HK, -1).transpose(0, 2, 1, 3)
    keys, values = cache.update_and_fetch(keys, values)
    sdpa = sys.modules[type(self)._mlxnb_qk_base.__module__].scaled_dot_product_attention
    out = sdpa(queries, keys, values, cache=cache, mask=mask, scale=self.scale)
    out = out.transpose(0, 2, 1, 3).reshape(B, 1, -1)
    return self[form.out](out if gate is None else out * mx.sigmoid(gate))


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
            elif _form(child) is not None:
                child._mlxnb_qk_form = _form(child)
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
                del child._mlxnb_qk_gate, child._mlxnb_qk_form
