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
  "kernel"  the kernel below
  "fast"    mx.fast.gated_delta_update (MLX's own, where its backend implements it)
  "ops"     mlx-lm's ops (what every other caller gets)
setup.py checks the compiled steps against the plain ones at load and falls back
down that list.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

__all__ = ["install", "tracing", "MODES"]

MODES = ("kernel", "fast", "ops")
_TRACING = [None]  # the mode of the trace being made (None: not an engine's step)
SEEN = [0]  # recurrences routed off mlx-lm's ops (a probe reads it)

_SOURCE = r"""
    constexpr int NPT = Dk / 32;
    const int n = blockIdx.z;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int lane = threadIdx.x;
    if (dv >= Dv) return;

    // q, k: [B, 1, Hk, Dk]; v, y: [B, 1, Hv, Dv]; g, beta: [B, 1, Hv]
    // state_in, state_out: [B, Hv, Dv, Dk] (lane i holds elements i*NPT .. i*NPT+NPT-1)
    const InT* q_ = q + (b * Hk + hk) * Dk + lane * NPT;
    const InT* k_ = k + (b * Hk + hk) * Dk + lane * NPT;
    const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk + lane * NPT;
    float st[NPT];
    float kk[NPT];
    const float gv = static_cast<float>(g[b * Hv + hv]);
    float kv = 0.f;
    for (int i = 0; i < NPT; i++) {
        kk[i] = static_cast<float>(k_[i]);
        st[i] = static_cast<float>(state_in[row + i]) * gv;
        kv += st[i] * kk[i];
    }
    for (int off = 16; off > 0; off /= 2) kv += __shfl_xor_sync(0xffffffffu, kv, off);
    const float delta = (static_cast<float>(v[(b * Hv + hv) * Dv + dv]) - kv)
        * static_cast<float>(beta[b * Hv + hv]);
    float out = 0.f;
    for (int i = 0; i < NPT; i++) {
        st[i] += kk[i] * delta;
        out += st[i] * static_cast<float>(q_[i]);
        state_out[row + i] = static_cast<StT>(st[i]);
    }
    for (int off = 16; off > 0; off /= 2) out += __shfl_xor_sync(0xffffffffu, out, off);
    if (lane == 0) y[(b * Hv + hv) * Dv + dv] = static_cast<InT>(out);
"""

_KERNEL = []


def _kernel():
    if not _KERNEL:
        _KERNEL.append(mx.fast.cuda_kernel(
            name="mlxnb_gated_delta_decode", input_names=["q", "k", "v", "g", "beta",
                                                          "state_in"],
            output_names=["y", "state_out"], source=_SOURCE))
    return _KERNEL[0]


def decode_step(q, k, v, g, beta, state):
    """One token of the gated delta rule: q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv],
    g, beta [B, 1, Hv], state [B, Hv, Dv, Dk] -> (y [B, 1, Hv, Dv], new state)."""
    B, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return _kernel()(
        inputs=[q, k, v, g, beta, state],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                  ("Hk", Hk), ("Hv", Hv), ("GT", g.dtype), ("BT", beta.dtype),
                  ("VT", v.dtype), ("KT", k.dtype)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, 1, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype])


def _fits(q, k, v, g, beta, state, mask) -> bool:
    return (mask is None and q.shape[1] == 1 and g.ndim == 3 and k.shape[-1] % 32 == 0
            and v.shape[2] % k.shape[2] == 0 and state.dtype == mx.float32
            and q.dtype == k.dtype)


def install() -> None:
    """Wrap mlx-lm's gated_delta_ops (idempotent); see the module's docstring."""
    from mlx_lm.models import gated_delta as gd
    orig = gd.gated_delta_ops
    if getattr(orig, "_mlxnb", False):
        return

    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
        mode = _TRACING[0]
        if (mode in ("kernel", "fast") and state is not None
                and _fits(q, k, v, g, beta, state, mask)):
            SEEN[0] += 1
            if mode == "kernel":
                return decode_step(q, k, v, g, beta, state)
            return tuple(mx.fast.gated_delta_update(q, k, v, g, beta, state))
        return orig(q, k, v, g, beta, state, mask)

    gated_delta_ops._mlxnb = True
    gd.gated_delta_ops = gated_delta_ops


@contextlib.contextmanager
def tracing(mode: str):
    """Marks the tracing of an engine's compiled recurrent decode step."""
    _TRACING[0] = mode
    try:
        yield
    finally:
        _TRACING[0] = None
