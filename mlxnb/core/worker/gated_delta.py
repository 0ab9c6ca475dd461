"""The gated delta rule's decode step (Qwen3.5, Qwen3-Next, Kimi Linear ...) in one
CUDA kernel, inside the engine's compiled recurrent steps.

mlx-lm runs the recurrence as a Metal kernel on Apple GPUs and as MLX ops everywhere
else (`mlx_lm.models.gated_delta.gated_delta_ops`): on CUDA a decode step then reads
and writes each row's [Hv, Dv, Dk] float32 state several times (decay, the key
product, the update, the query product are separate kernels; 1 MB a row and layer at
Qwen3.5-0.8B's sizes). This kernel is mlx-lm's Metal one for a single token, ported:
each warp owns one value row of one head's state, keeps it in registers, and reads
and writes it once.

Only traces of the engine's compiled decode steps (recurrent.py) take it:
`tracing(mode)` marks them, and `install()` wraps mlx-lm's `gated_delta_ops` so that
calls made inside such a trace, for one token without a mask, go to `mode`:
  "gates"   the kernel below, computing the gates too: mlx-lm's `gated_delta_update`
            (the caller that computes g and beta from the layer's projections) is
            wrapped as well, so per layer and step two launches fewer -- on a
            host-bound GPU a launch costs about the same whatever it does
  "kernel"  the kernel below, given g and beta
  "fast"    mx.fast.gated_delta_update (MLX's own, where its backend implements it)
  "ops"     mlx-lm's ops (what every other caller gets)
setup.py checks the compiled steps against the plain ones at load and falls back
down that list.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from . import kernel_files

__all__ = ["install", "tracing", "current", "fits_ab", "MODES"]

MODES = ("gates", "kernel", "fast", "ops")
_TRACING = [None]  # the mode of the trace being made (None: not an engine's step)
SEEN = [0]  # recurrences routed off mlx-lm's ops (a probe reads it)
# gated_delta_prefill's route for calls outside the traces, once it is offered:
# (gated_delta_update's arguments) -> its result, or None for mlx-lm's code
PREFILL = [None]

# Every input is read through its strides (the kernels are made with
# ensure_row_contiguous=False): v, a and b are slices of one fused projection's
# output, and a copy to make each contiguous would cost a launch of its own.
# A warp per value row of one head's state: grid (32, Dv, B * Hv), blocks (32, 4, 1).
_WARP_ROW = r"""
    constexpr int NPT = Dk / 32;
    const int n = blockIdx.z;
    const int bi = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int lane = threadIdx.x;
    if (dv >= Dv) return;
"""
_BODY = _WARP_ROW + r"""
    // q, k: [B, 1, Hk, Dk]; v: [B, 1, Hv, Dv]; gates: [B, 1, Hv] (A_log, dt_bias: [Hv])
    // state_in: [B, Hv, Dv, Dk]; y: [B, 1, Hv, Dv], state_out: [B, Hv, Dv, Dk]
    // (lane i holds elements i*NPT .. i*NPT+NPT-1 of a key-sized row)
    const int64_t qo = bi * q_strides[0] + hk * q_strides[2];
    const int64_t ko = bi * k_strides[0] + hk * k_strides[2];
    const int64_t so = bi * state_in_strides[0] + hv * state_in_strides[1]
        + dv * state_in_strides[2];
    const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk + lane * NPT;
    const int t = 0;  // (the gates' token)
GATES_HERE
    float kk[NPT];
    float qq[NPT];
    for (int i = 0; i < NPT; i++) {
        const int e = lane * NPT + i;
        kk[i] = static_cast<float>(k[ko + e * k_strides[3]]);
        qq[i] = static_cast<float>(q[qo + e * q_strides[3]]);
    }
NORM_HERE
    float st[NPT];
    float kv = 0.f;
    for (int i = 0; i < NPT; i++) {
        const int e = lane * NPT + i;
        st[i] = static_cast<float>(state_in[so + e * state_in_strides[3]]) * gv;
        kv += st[i] * kk[i];
    }
    for (int off = 16; off > 0; off /= 2) kv += __shfl_xor_sync(0xffffffffu, kv, off);
    const float vv = static_cast<float>(
        v[bi * v_strides[0] + hv * v_strides[2] + dv * v_strides[3]]);
    const float delta = (vv - kv) * bt;
    float out = 0.f;
    for (int i = 0; i < NPT; i++) {
        st[i] += kk[i] * delta;
        out += st[i] * qq[i];
        state_out[row + i] = static_cast<StT>(st[i]);
    }
    for (int off = 16; off > 0; off /= 2) out += __shfl_xor_sync(0xffffffffu, out, off);
    if (lane == 0) y[(bi * Hv + hv) * Dv + dv] = static_cast<InT>(out);
"""

# the decay g and the write strength beta, given
_GIVEN = r"""
    const float gv = static_cast<float>(
        g[bi * g_strides[0] + t * g_strides[1] + hv * g_strides[2]]);
    const float bt = static_cast<float>(
        beta[bi * beta_strides[0] + t * beta_strides[1] + hv * beta_strides[2]]);
"""

# ... or from the layer's raw projections, as mlx-lm's gated_delta_update computes
# them (beta = sigmoid(b), g = exp(-exp(A_log) * softplus(a + dt_bias))): each is
# otherwise a launch of its own per layer and step, as costly on the host as this one.
# Each op is MLX's own device functor at the dtype mlx-lm's ops give its result (BT:
# beta's, XT: a + dt_bias's), so the gates are bit for bit the ops' gates: g =
# exp(-A * softplus) turns one rounding of softplus into an error A times larger,
# and over a few steps of a random-weight model that moved the logits past the load
# check's tolerance
_OPS = """
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""
_FROM_AB = r"""
    namespace cu = mlx::core::cu;
    const float bt = static_cast<float>(cu::Sigmoid{}(static_cast<BT>(
        b_in[bi * b_in_strides[0] + t * b_in_strides[1] + hv * b_in_strides[2]])));
    const XT ax = cu::Add{}(static_cast<XT>(
                                a_in[bi * a_in_strides[0] + t * a_in_strides[1] + hv * a_in_strides[2]]),
                            static_cast<XT>(dt_bias[hv * dt_bias_strides[0]]));
    const float sp = static_cast<float>(cu::LogAddExp{}(ax, static_cast<XT>(0.f)));
    const float decay = cu::Negative{}(cu::Exp{}(static_cast<float>(A_log[hv * A_log_strides[0]])));
    const float gv = cu::Exp{}(cu::Multiply{}(decay, sp));
"""

# q and k as they come from the conv, L2-normalized here as mlx-lm's normalize_qk does
# it: mx.fast.rms_norm (x * rsqrt(mean(x^2) + eps) in float32, rounded to InT), then
# times its scale rounded to InT, as MLX rounds a Python scalar to the array's dtype
# (norm: q's scale, k's scale, eps as rms_norm takes it; float32)
_NORM = r"""
    float qs = 0.f, ks = 0.f;
    for (int i = 0; i < NPT; i++) {
        qs += qq[i] * qq[i];
        ks += kk[i] * kk[i];
    }
    for (int off = 16; off > 0; off /= 2) {
        qs += __shfl_xor_sync(0xffffffffu, qs, off);
        ks += __shfl_xor_sync(0xffffffffu, ks, off);
    }
    const float qr = rsqrtf(qs / Dk + norm[2]);
    const float kr = rsqrtf(ks / Dk + norm[2]);
    const float qsc = static_cast<float>(static_cast<InT>(norm[0]));
    const float ksc = static_cast<float>(static_cast<InT>(norm[1]));
    for (int i = 0; i < NPT; i++) {
        qq[i] = static_cast<float>(static_cast<InT>(
            static_cast<float>(static_cast<InT>(qq[i] * qr)) * qsc));
        kk[i] = static_cast<float>(static_cast<InT>(
            static_cast<float>(static_cast<InT>(kk[i] * kr)) * ksc));
    }
"""

_KERNEL = {}
_NORM_CONSTS = {}


def _kernel(from_ab: bool, norm: bool = False):
    if (from_ab, norm) not in _KERNEL:
        gates = ["a_in", "b_in", "A_log", "dt_bias"] if from_ab else ["g", "beta"]
        _KERNEL[from_ab, norm] = kernel_files.cuda_kernel(
            name="mlxnb_gated_delta_" + ("ab" if from_ab else "decode")
            + ("_norm" if norm else ""),
            input_names=["q", "k", "v", *gates, "state_in"] + (["norm"] if norm else []),
            output_names=["y", "state_out"],
            source=_BODY.replace("GATES_HERE", _FROM_AB if from_ab else _GIVEN)
            .replace("NORM_HERE", _NORM if norm else ""),
            header=_OPS if from_ab else "",
            ensure_row_contiguous=False)
    return _KERNEL[from_ab, norm]


def _launch(q, k, v, gates, state, norm=None):
    B, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    rounding = []
    if len(gates) == 4:  # a, b, A_log, dt_bias
        a, b, _, dt_bias = gates
        xt = a.dtype if a.dtype == dt_bias.dtype else mx.float32
        rounding = [("BT", b.dtype), ("XT", xt)]
    return _kernel(len(gates) == 4, norm is not None)(
        inputs=[q, k, v, *gates, state] + ([norm] if norm is not None else []),
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                  ("Hk", Hk), ("Hv", Hv), *rounding],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, 1, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype])


def decode_step(q, k, v, g, beta, state):
    """One token of the gated delta rule: q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv],
    g, beta [B, 1, Hv], state [B, Hv, Dv, Dk] -> (y [B, 1, Hv, Dv], new state)."""
    return _launch(q, k, v, (g, beta), state)


def decode_step_ab(q, k, v, a, b, A_log, dt_bias, state):
    """The same, from the gates' raw projections a, b [B, 1, Hv] and the layer's
    A_log, dt_bias [Hv] (mlx-lm's `gated_delta_update` arguments)."""
    return _launch(q, k, v, (a, b, A_log, dt_bias), state)


def decode_step_normed(q, k, v, a, b, A_log, dt_bias, state, inv_scale: float, eps: float):
    """decode_step_ab from q and k before mlx-lm's `normalize_qk(q, k,
    inv_scale=inv_scale, eps=eps)`, which the kernel applies itself: on CUDA that is
    six launches a layer fewer (two copies that make q and k contiguous for
    rms_norm, the two norms, the two scales)."""
    key = (inv_scale, eps)
    norm = _NORM_CONSTS.get(key)
    if norm is None:  # made once: inside a compiled step every op is replayed per call
        norm = _NORM_CONSTS[key] = mx.array(
            [inv_scale ** 2, inv_scale, eps * inv_scale ** 2], mx.float32)
    return _launch(q, k, v, (a, b, A_log, dt_bias), state, norm)


def gates(a, b, A_log, dt_bias):
    """(g, beta) from the raw projections in MLX ops: decode_step_ab's gates, op for
    op (mlx-lm's compute_g and sigmoid)."""
    sp = mx.logaddexp(a + dt_bias, 0)
    g = mx.exp(-mx.exp(A_log.astype(mx.float32)) * sp)
    return g, mx.sigmoid(b)


def _fits(q, k, v, g, beta, state, mask) -> bool:
    if not (k.ndim == v.ndim == 4):
        return False
    B, _, Hk, Dk = k.shape
    return (mask is None and q.shape[1] == 1 and g.ndim == 3 and Dk % 32 == 0
            and q.shape == k.shape and v.shape[2] % Hk == 0
            and state.shape == (B, v.shape[2], v.shape[3], Dk)
            and state.dtype == mx.float32 and q.dtype == k.dtype)


def fits_ab(q, k, v, a, b, A_log, dt_bias, state, mask=None) -> bool:
    """decode_step_ab (and decode_step_normed) takes these."""
    Hv = v.shape[2]
    return (_fits(q, k, v, a, b, state, mask) and a.shape == b.shape == (q.shape[0], 1, Hv)
            and A_log.shape == dt_bias.shape == (Hv,))


def _wrap_update(orig):
    """mlx-lm's gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, ...),
    which computes g and beta and then calls gated_delta_ops. With the plain gates
    (no lower bound, beta in [0, 1]): in a "gates" trace, one token, one kernel for
    all; outside any trace, the prefill route where it is offered."""
    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        plain = (kw.get("lower_bound") is None and not kw.get("allow_neg_eigval")
                 and kw.get("use_kernel", True))  # (False: a training forward)
        if (plain and _TRACING[0] == "gates" and state is not None
                and fits_ab(q, k, v, a, b, A_log, dt_bias, state, mask)):
            SEEN[0] += 1
            return decode_step_ab(q, k, v, a, b, A_log, dt_bias, state)
        if plain and _TRACING[0] is None and PREFILL[0] is not None:
            out = PREFILL[0](q, k, v, a, b, A_log, dt_bias, state, mask)
            if out is not None:
                return out
        return orig(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)

    gated_delta_update._mlxnb = True
    return gated_delta_update


def install() -> None:
    """Wrap mlx-lm's gated_delta_ops, and gated_delta_update where a loaded model
    module imported it by name (idempotent; call it after loading a model); see
    the module's docstring."""
    import sys

    from mlx_lm.models import gated_delta as gd
    for name, mod in list(sys.modules.items()):
        update = getattr(mod, "gated_delta_update", None)
        if (name.startswith("mlx_lm.models.") and mod is not gd
                and update is gd.gated_delta_update):
            mod.gated_delta_update = _wrap_update(update)
    orig = gd.gated_delta_ops
    if getattr(orig, "_mlxnb", False):
        return

    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
        mode = _TRACING[0]
        if (mode in ("gates", "kernel", "fast") and state is not None
                and _fits(q, k, v, g, beta, state, mask)):
            SEEN[0] += 1
            if mode != "fast":
                return decode_step(q, k, v, g, beta, state)
            return tuple(mx.fast.gated_delta_update(q, k, v, g, beta, state))
        return orig(q, k, v, g, beta, state, mask)

    gated_delta_ops._mlxnb = True
    gd.gated_delta_ops = gated_delta_ops


def current():
    """The mode of the engine's recurrent step being traced now, or None."""
    return _TRACING[0]


@contextlib.contextmanager
def tracing(mode: str):
    """Marks the tracing of an engine's compiled recurrent decode step."""
    _TRACING[0] = mode
    try:
        yield
    finally:
        _TRACING[0] = None
