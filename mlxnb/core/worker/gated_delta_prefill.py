"""The gated delta rule over a whole chunk of tokens in one CUDA kernel: the prefill
of Qwen3.5-style delta-nets, and their plain (uncompiled) one-token forwards, on the
engine's worker.

On CUDA mlx-lm runs the recurrence as a Python loop over the tokens
(`mlx_lm.models.gated_delta.gated_delta_ops`): per token and layer one compiled step
of four fused kernels (five with a padding mask). A prompt of T tokens is 4-5 T
launches a layer, and on a fresh machine those fused kernels are NVRTC compiles of
some 20 s, one after another, that a load waited for (the Qwen3.5 shape's floor in
bench/results/first-token-2026-12-06-h100.md). Here it is one launch a layer and
chunk: gated_delta.py's decode kernel with a loop over the tokens. Each warp keeps
one value row of one head's state in registers for the whole chunk; the gates come
from the layer's raw projections as the decode kernel computes them (mlx-lm's
compute_g and sigmoid, bit for bit); a masked token (a padded group's padding, on
either side) leaves the state as it was and gets y = 0, as in mlx-lm's Metal kernel
(its ops compute a value there that nothing reads: every later layer masks the
padding, and prefill keeps no outputs but the last real token's).

Which calls take it: mlx-lm's `gated_delta_update` with the plain gates (wrapped by
gated_delta.install), outside the engine's compiled decode traces, on a thread that
`offer` marked (an engine's worker: any other caller of the model runs mlx-lm's
code), at sizes that `check` found equal to mlx-lm's ops. The load's decode check
compares the compiled decode steps with plain forwards whose recurrence is
`reference` (`as_reference`): mlx-lm's math, not this kernel's. Offered before the
load's survey, the kernel leaves mlx-lm's per-token step out of the kernels compiled
ahead, so a load whose check turns it down compiles that step itself (some 20 s on a
fresh CUDA machine). `MLXNB_DELTA_PREFILL=0` keeps mlx-lm's loop (a bench's other
arm).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Optional, Set, Tuple

import mlx.core as mx

from . import gated_delta, kernel_files

__all__ = ["offer", "check", "taken", "prefill", "reference", "as_reference", "warm_call",
           "layer_key", "wanted"]

_BODY = gated_delta._WARP_ROW + r"""    const int T = q_shape[1];

    // q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a_in, b_in: [B, T, Hv]; mask: [B, T]
    // state_in: [B, Hv, Dv, Dk]; y: [B, T, Hv, Dv], state_out: [B, Hv, Dv, Dk]
    // (lane i holds elements i*NPT .. i*NPT+NPT-1 of a key-sized row)
    const int64_t so = bi * state_in_strides[0] + hv * state_in_strides[1]
        + dv * state_in_strides[2];
    float st[NPT];
    for (int i = 0; i < NPT; i++) {
        st[i] = static_cast<float>(state_in[so + (lane * NPT + i) * state_in_strides[3]]);
    }
    for (int t = 0; t < T; t++) {
        const int64_t qo = bi * q_strides[0] + t * q_strides[1] + hk * q_strides[2];
        const int64_t ko = bi * k_strides[0] + t * k_strides[1] + hk * k_strides[2];
GATES_HERE
        float kk[NPT];
        float qq[NPT];
        float nt[NPT];
        float kv = 0.f;
        for (int i = 0; i < NPT; i++) {
            const int e = lane * NPT + i;
            kk[i] = static_cast<float>(k[ko + e * k_strides[3]]);
            qq[i] = static_cast<float>(q[qo + e * q_strides[3]]);
            nt[i] = st[i] * gv;
            kv += nt[i] * kk[i];
        }
        for (int off = 16; off > 0; off /= 2) kv += __shfl_xor_sync(0xffffffffu, kv, off);
        const float vv = static_cast<float>(
            v[bi * v_strides[0] + t * v_strides[1] + hv * v_strides[2] + dv * v_strides[3]]);
        const float delta = (vv - kv) * bt;
        float out = 0.f;
        for (int i = 0; i < NPT; i++) {
            nt[i] += kk[i] * delta;
            out += nt[i] * qq[i];
        }
        for (int off = 16; off > 0; off /= 2) out += __shfl_xor_sync(0xffffffffu, out, off);
        const bool keep = mask[bi * mask_strides[0] + t * mask_strides[1]];
        if (keep) {
            for (int i = 0; i < NPT; i++) st[i] = nt[i];
        }
        if (lane == 0) {
            y[((static_cast<int64_t>(bi) * T + t) * Hv + hv) * Dv + dv] =
                static_cast<InT>(keep ? out : 0.f);
        }
    }
    const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk + lane * NPT;
    for (int i = 0; i < NPT; i++) state_out[row + i] = static_cast<StT>(st[i]);
"""

_KERNEL = []
_LOCAL = threading.local()  # .keys: the sizes this thread's forwards take it at


def wanted() -> bool:
    from .kv_attention import cuda_backend

    return cuda_backend() and os.environ.get("MLXNB_DELTA_PREFILL", "1") != "0"


def _kernel():
    if not _KERNEL:
        _KERNEL.append(kernel_files.cuda_kernel(
            name="mlxnb_gated_delta_prefill",
            input_names=["q", "k", "v", "a_in", "b_in", "A_log", "dt_bias", "state_in",
                         "mask"],
            output_names=["y", "state_out"],
            source=_BODY.replace("GATES_HERE", gated_delta._FROM_AB),
            header=gated_delta._OPS, ensure_row_contiguous=False))
    return _KERNEL[0]


def prefill(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    """mlx-lm's gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask) with
    the plain gates: q, k [B, T, Hk, Dk] (normalized), v [B, T, Hv, Dv], a, b
    [B, T, Hv], A_log, dt_bias [Hv], state [B, Hv, Dv, Dk] float32 or None (zeros),
    mask [B, T] bool or None -> (y [B, T, Hv, Dv], new state)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if mask is None:  # (a broadcast: strides of 0, no buffer of B x T)
        mask = mx.broadcast_to(mx.array(True), (B, T))
    xt = a.dtype if a.dtype == dt_bias.dtype else mx.float32
    return _kernel()(
        inputs=[q, k, v, a, b, A_log, dt_bias, state, mask],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                  ("Hk", Hk), ("Hv", Hv), ("BT", b.dtype), ("XT", xt)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype])


def fits(q, k, v, a, b, A_log, dt_bias, state, mask) -> bool:
    if not (q.ndim == k.ndim == v.ndim == 4 and q.shape == k.shape):
        return False
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return (Dk % 32 == 0 and Hv % Hk == 0 and v.shape[:2] == (B, T) and q.dtype == k.dtype
            and a.shape == b.shape == (B, T, Hv) and A_log.shape == dt_bias.shape == (Hv,)
            and (state is None or (state.shape == (B, Hv, Dv, Dk)
                                   and state.dtype == mx.float32))
            and (mask is None or (mask.shape == (B, T) and mask.dtype == mx.bool_)))


def _key(q, v) -> tuple:
    return (str(q.dtype), q.shape[2], v.shape[2], q.shape[3], v.shape[3])


def _route(q, k, v, a, b, A_log, dt_bias, state, mask):
    """gated_delta's hook: this kernel's result, or None for mlx-lm's code."""
    keys = getattr(_LOCAL, "keys", None)
    if not keys or not fits(q, k, v, a, b, A_log, dt_bias, state, mask):
        return None
    if _key(q, v) not in keys:
        return None
    if getattr(_LOCAL, "reference", False):
        y, state = reference(q, k, v, a, b, A_log, dt_bias, state, mask)
        return (y if mask is None else mx.where(mask[..., None, None], y, 0).astype(y.dtype),
                state)
    return prefill(q, k, v, a, b, A_log, dt_bias, state, mask)


@contextlib.contextmanager
def as_reference():
    """Calls that would take the kernel take `reference` instead (mlx-lm's math in
    uncompiled ops, which compile nothing) on this thread, for a check whose plain
    side should be mlx-lm's and not this kernel."""
    _LOCAL.reference = True
    try:
        yield
    finally:
        _LOCAL.reference = False


def layer_key(m) -> Optional[tuple]:
    """(dtype, Hk, Hv, Dk, Dv) of an mlx-lm GatedDeltaNet (Qwen3.5, Qwen3-Next), as its
    calls give them; None for other modules."""
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "A_log", "dt_bias")
    conv = getattr(m, "conv1d", None)
    if not type(m).__name__.endswith("GatedDeltaNet") or not all(hasattr(m, n) for n in names):
        return None
    w = getattr(conv, "weight", None)
    if not isinstance(w, mx.array) or not mx.issubdtype(w.dtype, mx.floating):
        return None
    if m.head_k_dim % 32 or m.num_v_heads % m.num_k_heads:  # (a warp per value row)
        return None
    return (str(w.dtype), m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim)


def _keys(model) -> Set[tuple]:
    return {k for _, m in model.named_modules() if (k := layer_key(m)) is not None}


def offer(model) -> int:
    """On CUDA: this thread's forwards of `model` take the kernel at its delta-nets'
    sizes from here, until `check` says otherwise (so a survey of the load's forwards
    sees what the load will run); how many sizes. The sizes other engines on this
    thread (the worker is one per process) checked stay."""
    keys = _keys(model) if wanted() else set()
    _LOCAL.keys = getattr(_LOCAL, "keys", set()) | keys
    if keys:
        gated_delta.install()
        gated_delta.PREFILL[0] = _route
    return len(keys)


def taken(model) -> bool:
    """Do this thread's forwards of `model` take the kernel (offered, and checked)?"""
    return bool(_keys(model) & getattr(_LOCAL, "keys", set()))


def reference(q, k, v, a, b, A_log, dt_bias, state, mask):
    """mlx-lm's gated_delta_update on its ops path (compute_g, sigmoid, then
    `_gated_delta_step_ops` token by token), op for op, uncompiled: MLX ships every
    op here built, so on CUDA this compiles nothing (the check's reference)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    g, beta = gated_delta.gates(a, b, A_log, dt_bias)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q, k = (mx.repeat(x, Hv // Hk, -2) for x in (q, k))
    ys = []
    for t in range(T):
        old = state
        state = state * g[:, t][..., None, None]
        kv_mem = (state * k[:, t][..., None, :]).sum(axis=-1)  # [B, Hv, Dv]
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + k[:, t][..., None, :] * delta[..., None]
        ys.append((state * q[:, t][..., None, :]).sum(axis=-1).astype(q.dtype))
        if mask is not None:
            state = mx.where(mask[:, t][:, None, None, None], state, old)
    return mx.stack(ys, axis=1), state


def _inputs(key: tuple, A_log, dt_bias, T: int = 6, seed: int = 0):
    """Random inputs at a layer's sizes as its calls give them: q and k L2-normalized;
    v, a and b strided slices of wider projections (fused ones, fuse.py); three rows,
    one whole, one left-padded, one right-padded; a state."""
    dt, Hk, Hv, Dk, Dv = key
    dt = getattr(mx, dt.rsplit(".", 1)[-1])
    B = 3
    ks = mx.random.split(mx.random.key(seed), 6)
    q, k = (mx.random.normal((B, T, Hk, Dk), key=ks[i]) for i in (0, 1))
    q, k = ((x / mx.sqrt((x * x).sum(-1, keepdims=True))).astype(dt) for x in (q, k))
    wide = mx.random.normal((B, T, Hv * Dv + 16), key=ks[2]).astype(dt)
    v = wide[..., 16:].reshape(B, T, Hv, Dv)
    ab = mx.random.normal((B, T, 2 * Hv + 8), key=ks[3]).astype(dt)
    a, b = ab[..., 8:8 + Hv], ab[..., 8 + Hv:]
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=ks[5])
    at = mx.arange(T)[None, :]
    mask = (at >= mx.array([0, 2, 0])[:, None]) & (at < mx.array([T, T, T - 2])[:, None])
    return q, k, v, a, b, A_log, dt_bias, state, mask


def check(model) -> str:
    """'' if the kernel gives mlx-lm's ops' outputs and states at each size of the
    model's delta-nets this thread offered it at (each with a layer's own A_log and
    dt_bias, with left padding and without); else what differs, and no forward takes
    it at that size."""
    keys = getattr(_LOCAL, "keys", set())
    layers = {}  # (a size another engine checked is checked again: cheap, the same)
    for _, m in model.named_modules():
        key = layer_key(m)
        if key in keys:
            layers.setdefault(key, m)
    first = ""
    for key, m in layers.items():
        why = _differs(key, m)
        if why:
            _LOCAL.keys = _LOCAL.keys - {key}
            first = first or why
    return first


def _differs(key: tuple, m) -> str:
    for masked in (True, False):
        args = list(_inputs(key, m.A_log, m.dt_bias))
        if not masked:
            args[-1] = None
        try:
            got, want = prefill(*args), reference(*args)
            mx.eval(got, want)
        except Exception as e:
            return f"kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
        if not _close(got, want, args[-1]):
            return "kernel differs from mlx-lm's ops"
    return ""


def _close(got, want, mask) -> bool:
    """y within 1% of the largest |y| where the token counts, and the state within
    1e-3 of the largest |state|: float32 sums in another order move the last bits
    (and bfloat16 y by one step); a wrong head, stride or mask moves whole values."""
    (y, s), (y_ref, s_ref) = got, want
    y, y_ref = y.astype(mx.float32), y_ref.astype(mx.float32)
    if mask is not None:
        y, y_ref = (mx.where(mask[..., None, None], x, 0.0) for x in (y, y_ref))
        if (mx.where(mask[..., None, None], 0.0, got[0].astype(mx.float32)) != 0).any():
            return False
    ok_y = (y - y_ref).abs().max() <= 0.01 * mx.maximum(y_ref.abs().max(), 1e-3)
    ok_s = (s - s_ref).abs().max() <= 1e-3 * mx.maximum(s_ref.abs().max(), 1e-3)
    return bool((ok_y & ok_s).item())


def warm_call(m) -> Optional[Tuple[tuple, Callable]]:
    """(key, call): at a delta-net's sizes, on zeros, this kernel and the decode
    kernel that compiled decode steps run (gated_delta.decode_step_normed), which
    MLX names by the same template arguments (own_kernels.py)."""
    key = layer_key(m)
    if key is None or not wanted():
        return None
    dt, Hk, Hv, Dk, Dv = key
    dt = getattr(mx, dt.rsplit(".", 1)[-1])
    q, v, a = (mx.zeros((1, 2, h, d), dt) for h, d in ((Hk, Dk), (Hv, Dv), (Hv, 1)))
    a = a[..., 0]
    state = mx.zeros((1, Hv, Dv, Dk), mx.float32)

    def run():
        one = [x[:, :1] for x in (q, q, v, a, a)]
        return (prefill(q, q, v, a, a, m.A_log, m.dt_bias, state, mx.zeros((1, 2), mx.bool_))
                + gated_delta.decode_step_normed(*one, m.A_log, m.dt_bias, state,
                                                 Dk ** -0.5, 1e-6))

    return key + (str(m.A_log.dtype), str(m.dt_bias.dtype)), run
