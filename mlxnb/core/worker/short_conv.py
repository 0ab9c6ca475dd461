"""Recurrent layers' short convs, decoded a token at a time in one CUDA kernel, inside
the engine's compiled recurrent steps.

After its input projection, mlx-lm's LFM2 `ShortConv` decodes a token in four
launches: the input gate `B * x`, the concatenation with the conv state, the
depthwise conv (cuDNN on CUDA) and the output gate `C * conv`; Qwen3.5's gated
delta-net in four too: the concatenation, the conv, its SiLU and a contiguous copy of
the new state. A decode step is host-bound on GPUs at these sizes and MLX's CUDA
backend costs the host about the same per launch whatever the kernel does, so here
each four are one kernel: a thread owns one channel of one row, reads its L-1 state
values and its inputs once, and writes its output and its shifted state. LFM2-1.2B
has ten such layers and Qwen3.5-0.8B eighteen: 30 and 54 launches fewer a step.

Only traces of the engine's compiled decode steps in a kernel mode take them
(`gated_delta.tracing("gates" | "kernel")`, which recurrent.py holds while tracing);
the load check (setup.py) compares the compiled steps with mlx-lm's plain ones and
falls back to the modes without them. `adopt` gives a layer's ShortConv or
GatedDeltaNet a subclass (on this instance) whose one-token calls in such a trace
take the kernel; every other call is mlx-lm's. The gated delta-net's one-token call
is mlx-lm's code with the conv swapped (`_delta_net_token`).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn

from . import gated_delta, kernel_files

__all__ = ["adopt", "release", "gated_step", "silu_step", "wanted", "SEEN"]

KERNEL_MODES = ("gates", "kernel")
SEEN = [0]  # short convs routed to a kernel (a probe reads it)

# state_in: [B, L-1, C] and w: [C, L, 1] (a depthwise conv) read through their
# strides; y: [B, 1, C] and state_out: [B, L-1, C], contiguous. A thread owns channel
# `ch` of row `b`; the conv sums in float32 and each result rounds to InT where
# mlx-lm's ops round it. INPUT_HERE sets `xin`, the token's conv input; OUTPUT_HERE
# writes y from `conv`.
_BODY = r"""
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (ch >= C) return;
INPUT_HERE
    const int64_t so = b * state_in_strides[0] + ch * state_in_strides[2];
    const int64_t wo = ch * w_strides[0];
    const int64_t out = static_cast<int64_t>(b) * (L - 1) * C + ch;
    float acc = 0.f;
    for (int i = 0; i < L - 1; i++) {
        const InT s = state_in[so + i * state_in_strides[1]];
        acc += static_cast<float>(s) * static_cast<float>(w[wo + i * w_strides[1]]);
        if (i > 0) state_out[out + (i - 1) * C] = s;
    }
    acc += static_cast<float>(xin) * static_cast<float>(w[wo + (L - 1) * w_strides[1]]);
    state_out[out + (L - 2) * C] = xin;
    const InT conv = static_cast<InT>(acc);
OUTPUT_HERE
"""

# LFM2: bcx [B, 1, 3C] = (input gate, output gate, x); the conv reads B * x and the
# output is C * conv
_GATED_IN = r"""
    const int64_t r = b * bcx_strides[0];
    const int64_t c = bcx_strides[2];
    const InT xin = static_cast<InT>(static_cast<float>(bcx[r + ch * c])
                                     * static_cast<float>(bcx[r + (2 * C + ch) * c]));
"""
_GATED_OUT = r"""
    y[static_cast<int64_t>(b) * C + ch] = static_cast<InT>(
        static_cast<float>(bcx[r + (C + ch) * c]) * static_cast<float>(conv));
"""
# the gated delta-net: x [B, 1, C] (a slice of the fused in-projection); the output is
# SiLU(conv) as nn.silu computes it, x * sigmoid(x): MLX's own sigmoid at InT (its
# ops round at InT, so a float32 sigmoid would differ in the last bit), then the
# product rounded to InT
_SILU_IN = r"""
    const InT xin = x[b * x_strides[0] + ch * x_strides[2]];
"""
_SILU_OUT = r"""
    const InT sg = mlx::core::cu::Sigmoid{}(conv);
    y[static_cast<int64_t>(b) * C + ch] = static_cast<InT>(
        static_cast<float>(conv) * static_cast<float>(sg));
"""
_SILU_HEADER = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'

_KERNEL = {}


def _kernel(gated: bool):
    if gated not in _KERNEL:
        _KERNEL[gated] = kernel_files.cuda_kernel(
            name="mlxnb_short_conv_" + ("gated" if gated else "silu"),
            input_names=["bcx" if gated else "x", "state_in", "w"],
            output_names=["y", "state_out"],
            source=_BODY.replace("INPUT_HERE", _GATED_IN if gated else _SILU_IN)
            .replace("OUTPUT_HERE", _GATED_OUT if gated else _SILU_OUT),
            header="" if gated else _SILU_HEADER, ensure_row_contiguous=False)
    return _KERNEL[gated]


def _launch(gated: bool, x, state, w):
    B, C, L = x.shape[0], w.shape[0], w.shape[1]
    return _kernel(gated)(
        inputs=[x, state, w], template=[("InT", x.dtype), ("C", C), ("L", L)],
        grid=(-(-C // 256) * 256, B, 1), threadgroup=(256, 1, 1),
        output_shapes=[(B, 1, C), state.shape], output_dtypes=[x.dtype, x.dtype])


def gated_step(bcx, state, w):
    """One token of LFM2's gated short conv: bcx [B, 1, 3C] (gate B, gate C, x),
    state [B, L-1, C], w [C, L, 1] -> (C * conv(B * x) [B, 1, C], new state)."""
    return _launch(True, bcx, state, w)


def silu_step(x, state, w):
    """One token of a depthwise conv and its SiLU: x [B, 1, C], state [B, L-1, C],
    w [C, L, 1] -> (silu(conv(x)) [B, 1, C], new state [B, L-1, C])."""
    return _launch(False, x, state, w)


def wanted() -> bool:
    """`MLXNB_CONV_KERNEL=0` keeps mlx-lm's ops in the compiled steps (a bench's
    other arm)."""
    return os.environ.get("MLXNB_CONV_KERNEL", "1") != "0"


def _depthwise(conv, length) -> bool:
    """A bias-free depthwise nn.Conv1d of kernel size `length`, as the kernels read it."""
    if not isinstance(conv, nn.Conv1d) or "bias" in conv:
        return False
    w = conv.weight
    return (w.ndim == 3 and w.shape[2] == 1 and w.shape[1] == length and length >= 2
            and getattr(conv, "groups", 0) == w.shape[0])


def _kind(m):
    """'gated' for mlx-lm's LFM2 ShortConv, 'silu' for Qwen3.5's GatedDeltaNet, as the
    kernels read them; else None."""
    if not isinstance(m, nn.Module) or hasattr(type(m), "_mlxnb_conv_base"):
        return None
    name = type(m).__name__
    if name == "ShortConv" and all(hasattr(m, a) for a in ("in_proj", "out_proj", "L_cache")):
        return "gated" if _depthwise(m.get("conv"), m.L_cache) else None
    mod = sys.modules.get(type(m).__module__)
    if (name == "GatedDeltaNet" and hasattr(mod, "normalize_qk")
            and hasattr(mod, "gated_delta_update") and getattr(m, "sharding_group", 0) is None
            and all(hasattr(m, a) for a in (
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias",
                "norm", "out_proj", "key_dim", "head_k_dim", "head_v_dim", "num_k_heads",
                "num_v_heads", "conv_kernel_size"))):
        return "silu" if _depthwise(m.get("conv1d"), m.conv_kernel_size) else None
    return None


def _takes(x, mask, cache, n) -> bool:
    """A one-token call of a compiled trace in a kernel mode, its state present."""
    return (gated_delta.current() in KERNEL_MODES and mask is None and cache is not None
            and x.shape[1] == 1 and getattr(cache, "lengths", None) is None
            and all(cache[i] is not None for i in range(n)))


def _fits(x, state, w) -> bool:
    return (state.dtype == x.dtype == w.dtype
            and state.shape == (x.shape[0], w.shape[1] - 1, w.shape[0]))


def _short_conv_token(self, x, cache):
    bcx = self.in_proj(x)
    w, state = self.conv.weight, cache[0]
    if bcx.shape[-1] != 3 * w.shape[0] or not _fits(bcx, state, w):
        return None
    SEEN[0] += 1
    y, cache[0] = gated_step(bcx, state, w)
    cache.advance(1)
    return self.out_proj(y)


def _delta_net_token(self, inputs, cache):
    """mlx-lm's GatedDeltaNet.__call__ for one token (mlx_lm/models/qwen3_5.py), its
    concatenate-conv-SiLU-contiguous as silu_step and, in a "gates" trace, its
    normalize_qk inside the gated delta kernel (gated_delta.decode_step_normed)."""
    w = self.conv1d.weight
    B = inputs.shape[0]
    qkv = self.in_proj_qkv(inputs)
    if not _fits(qkv, cache[0], w):
        return None
    mod = sys.modules[type(self)._mlxnb_conv_base.__module__]
    z = self.in_proj_z(inputs).reshape(B, 1, self.num_v_heads, self.head_v_dim)
    b = self.in_proj_b(inputs)
    a = self.in_proj_a(inputs)
    SEEN[0] += 1
    conv_out, cache[0] = silu_step(qkv, cache[0], w)
    q, k, v = [t.reshape(B, 1, h, d) for t, h, d in zip(
        mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
        [self.num_k_heads, self.num_k_heads, self.num_v_heads],
        [self.head_k_dim, self.head_k_dim, self.head_v_dim])]
    inv_scale, state = self.head_k_dim ** -0.5, cache[1]
    if gated_delta.current() == "gates" and gated_delta.fits_ab(
            q, k, v, a, b, self.A_log, self.dt_bias, state):  # normalize_qk inside
        gated_delta.SEEN[0] += 1
        out, cache[1] = gated_delta.decode_step_normed(
            q, k, v, a, b, self.A_log, self.dt_bias, state, inv_scale, 1e-6)
    else:
        q, k = mod.normalize_qk(q, k, inv_scale=inv_scale, eps=1e-6)
        out, cache[1] = mod.gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias,
                                               state, None, use_kernel=not self.training)
    cache.advance(1)
    out = self.norm(out, z)
    return self.out_proj(out.reshape(B, 1, -1))


_SUBCLASSES = {}


def _subclass(cls, kind: str):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        token, nstate = ((_short_conv_token, 1) if kind == "gated"
                         else (_delta_net_token, 2))

        def __call__(self, x, mask=None, cache=None):
            if _takes(x, mask, cache, nstate):
                y = token(self, x, cache)
                if y is not None:
                    return y
            return cls.__call__(self, x, mask, cache)

        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__doc__": cls.__doc__,
            "_mlxnb_conv_base": cls})
    return sub


def adopt(layer) -> int:
    """Give the short convs among `layer`'s children the kernel path; how many."""
    if not (isinstance(layer, nn.Module) and wanted()):
        return 0
    n = 0
    for child in layer.children().values():
        kind = _kind(child)
        if kind is not None:
            child.__class__ = _subclass(type(child), kind)
            n += 1
    return n


def release(layer) -> None:
    """Put `layer`'s short convs back to mlx-lm's class."""
    if isinstance(layer, nn.Module):
        for child in layer.children().values():
            base = getattr(type(child), "_mlxnb_conv_base", None)
            if base is not None:
                child.__class__ = base
