"""Short convs in the engine's compiled decode steps (short_conv.py): LFM2's gated
ShortConv and Qwen3.5's gated delta-net conv. Which calls take the kernels, that
their math is mlx-lm's, and that a kernel that disagrees is caught at load. Off CUDA
each kernel is stood in for by its math in MLX ops; the CUDA kernels themselves are
checked against mlx-lm's ops where the backend has them."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import normalize_qk

from mlxnb.core.worker import gated_delta, kv_attention, short_conv
from test_cache_kinds import build, prompts_through  # tests/ is on sys.path
from test_recurrent import _gd_reference, _load, _mlx_lm_tokens, on_worker


def _conv(state, x, w):
    """(the conv's output at the token in float32, the new state): its L taps summed
    in float32 over the window [state, x]."""
    window = mx.concatenate([state, x], axis=1)  # [B, L, C]
    out = (window.astype(mx.float32) * w[:, :, 0].T.astype(mx.float32)).sum(1, keepdims=True)
    return out.astype(x.dtype), window[:, 1:]


def gated_reference(bcx, state, w):
    C = w.shape[0]
    conv, st = _conv(state, bcx[..., :C] * bcx[..., 2 * C:], w)
    return bcx[..., C:2 * C] * conv, st


def silu_reference(x, state, w):
    conv, st = _conv(state, x, w)
    return nn.silu(conv), st


def _layer(model, name):
    return next(layer for layer in model.layers if name in layer)


def _call(module, x, state, n=1):
    c = ArraysCache(n)
    c[0] = state[0]
    if n == 2:
        c[1] = state[1]
    y = module(x, None, c)
    return y, c.cache


def _gdn_inputs(gdn, B, dtype, seed=0):
    mx.random.seed(seed)
    C, L = gdn.conv1d.weight.shape[:2]
    conv_state = mx.random.normal((B, L - 1, C)).astype(dtype)
    state = 0.1 * mx.random.normal((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim))
    return mx.random.normal((B, 1, gdn.hidden_size)).astype(dtype), [conv_state, state]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_kernels_math_is_mlx_lms(dtype):
    """The stand-ins' math (each kernel's, in MLX ops) gives mlx-lm's ShortConv and
    GatedDeltaNet one-token outputs and states."""
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    mx.random.seed(1)
    model = build("lfm2")
    model.set_dtype(dtype)
    conv = _layer(model, "conv").conv
    C, L = conv.conv.weight.shape[:2]
    state = mx.random.normal((3, L - 1, C)).astype(dtype)
    x = mx.random.normal((3, 1, C)).astype(dtype)
    want_y, (want_st,) = _call(conv, x, [state])
    y, st = gated_reference(conv.in_proj(x), state, conv.conv.weight)
    assert mx.allclose(conv.out_proj(y), want_y, atol=tol, rtol=tol).item()
    assert mx.array_equal(st, want_st).item()

    model = build("qwen3_5")
    model.set_dtype(dtype)
    gdn = _layer(model, "linear_attn").linear_attn
    x, state = _gdn_inputs(gdn, 3, dtype)
    qkv = gdn.in_proj_qkv(x)
    y, st = silu_reference(qkv, state[0], gdn.conv1d.weight)
    window = mx.concatenate([state[0], qkv], axis=1)
    assert mx.allclose(y, nn.silu(gdn.conv1d(window)), atol=tol, rtol=tol).item()
    assert mx.array_equal(st, window[:, 1:]).item()


def _stand_ins(monkeypatch, broken=False):
    """Every CUDA kernel a compiled recurrent step takes, as its math in MLX ops;
    the short convs' calls counted (and with `broken`, off by half)."""
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    calls = []

    def wrap(ref):
        def kernel(x, state, w):
            calls.append(x.shape)
            y, st = ref(x, state, w)
            return (y * 1.5 if broken else y), st
        return kernel

    monkeypatch.setattr(short_conv, "gated_step", wrap(gated_reference))
    monkeypatch.setattr(short_conv, "silu_step", wrap(silu_reference))
    monkeypatch.setattr(gated_delta, "decode_step", _gd_reference)
    monkeypatch.setattr(gated_delta, "decode_step_ab", lambda q, k, v, a, b, A_log, dt, st:
                        _gd_reference(q, k, v, *gated_delta.gates(a, b, A_log, dt), st))

    def normed(q, k, v, a, b, A_log, dt, st, inv_scale, eps):
        calls.append("normed")
        q, k = normalize_qk(q, k, inv_scale=inv_scale, eps=eps)
        return _gd_reference(q, k, v, *gated_delta.gates(a, b, A_log, dt), st)
    monkeypatch.setattr(gated_delta, "decode_step_normed", normed)
    return calls


@pytest.mark.parametrize("family,kind", [("lfm2", "conv"), ("qwen3_5", "linear_attn")])
@pytest.mark.parametrize("broken", [False, True])
def test_compiled_steps_run_the_kernel_checked_at_load(family, kind, broken, monkeypatch,
                                                       arun):
    """On a CUDA-like backend the compiled steps' short convs take the kernel (its
    stand-in here), with mlx-lm's tokens; a kernel that disagrees is caught by the
    load check and the steps keep mlx-lm's ops."""
    calls = _stand_ins(monkeypatch, broken)
    mx.random.seed(5)
    model = build(family, seed=5)

    tokens, ids, status = prompts_through(model, arun)
    assert calls  # traced (and checked) at least once
    assert ("normed" in calls) is (family == "qwen3_5")  # normalize_qk in the kernel
    assert ("(short conv: fused kernel)" in status) is not broken
    assert "recurrent decode compiled" in status
    mods = [type(layer[kind]) for layer in model.layers if kind in layer]
    assert mods and all(hasattr(m, "_mlxnb_conv_base") is not broken for m in mods)
    mx.random.seed(5)
    plain = build(family, seed=5)
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 8)


@pytest.mark.parametrize("family,kind,n", [("lfm2", "conv", 1),
                                           ("qwen3_5", "linear_attn", 2)])
def test_only_one_token_calls_in_a_kernel_trace_take_the_kernel(family, kind, n,
                                                                monkeypatch):
    calls = _stand_ins(monkeypatch)
    layer = _layer(build(family), kind)
    assert short_conv.adopt(layer) == 1
    assert short_conv.adopt(layer) == 0  # once
    m = layer[kind]
    if n == 1:
        C, L = m.conv.weight.shape[:2]
        state = [mx.random.normal((2, L - 1, C))]
        one, two = mx.random.normal((2, 1, C)), mx.random.normal((2, 2, C))
    else:
        one, state = _gdn_inputs(m, 2, mx.float32)
        two = mx.concatenate([one, one], axis=1)
    _call(m, one, state, n)  # not in a trace
    for mode in ("fast", "ops"):
        with gated_delta.tracing(mode):
            _call(m, one, state, n)
    with gated_delta.tracing("gates"):
        _call(m, two, state, n)  # a prefill chunk
        c = ArraysCache(n)
        c.cache = list(state)
        m(one, mx.ones((2, 1), mx.bool_), c)  # a padded group
        assert calls == []
        y, st = _call(m, one, state, n)
        assert len([c for c in calls if c != "normed"]) == 1
        assert ("normed" in calls) is (n == 2)  # the gated delta-net's normalize_qk
    want_y, want_st = _call(m, one, state, n)
    assert mx.allclose(y, want_y, atol=1e-4).item()
    assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(st, want_st))
    short_conv.release(layer)
    assert not hasattr(type(layer[kind]), "_mlxnb_conv_base")


def test_the_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MLXNB_CONV_KERNEL", "0")
    assert short_conv.adopt(_layer(build("lfm2"), "conv")) == 0
    assert short_conv.adopt(_layer(build("qwen3_5"), "linear_attn")) == 0


def test_a_conv_with_a_bias_keeps_mlx_lms_code():
    layer = _layer(build("lfm2"), "conv")
    layer.conv.conv.bias = mx.zeros((layer.conv.conv.weight.shape[0],))
    assert short_conv.adopt(layer) == 0


@pytest.mark.skipif(not kv_attention.cuda_backend(), reason="the CUDA kernels need CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 5, 64])
def test_the_cuda_kernels_are_mlx_lms(dtype, B):
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    mx.random.seed(B)
    model = build("lfm2")
    model.set_dtype(dtype)
    conv = _layer(model, "conv").conv
    C, L = conv.conv.weight.shape[:2]
    state = mx.random.normal((B, L - 1, C)).astype(dtype)
    x = mx.random.normal((B, 1, C)).astype(dtype)
    bcx = conv.in_proj(x)
    y, st = short_conv.gated_step(bcx, state, conv.conv.weight)
    ry, rst = gated_reference(bcx, state, conv.conv.weight)
    assert mx.array_equal(st, rst).item()
    assert mx.allclose(y, ry, atol=tol, rtol=tol).item()
    want_y, _ = _call(conv, x, [state])
    assert mx.allclose(conv.out_proj(y), want_y, atol=tol, rtol=tol).item()

    model = build("qwen3_5")
    model.set_dtype(dtype)
    gdn = _layer(model, "linear_attn").linear_attn
    x, state = _gdn_inputs(gdn, B, dtype, seed=B)
    qkv = gdn.in_proj_qkv(x)
    C = qkv.shape[-1]  # a strided slice, as fuse.py's parts are:
    qkv = mx.concatenate([qkv, qkv], axis=-1)[..., 1:1 + C]
    y, st = short_conv.silu_step(qkv, state[0], gdn.conv1d.weight)
    ry, rst = silu_reference(qkv, state[0], gdn.conv1d.weight)
    assert mx.array_equal(st, rst).item()
    assert mx.allclose(y, ry, atol=tol, rtol=tol).item()
    # normalize_qk inside the gated delta kernel
    conv = mx.random.normal((B, 1, C)).astype(dtype)
    q, k, v = [t.reshape(B, 1, h, d) for t, h, d in zip(
        mx.split(conv, [gdn.key_dim, 2 * gdn.key_dim], -1),
        [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
        [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim])]
    a, b = mx.random.normal((2, B, 1, gdn.num_v_heads)).astype(dtype)
    inv = gdn.head_k_dim ** -0.5
    got = gated_delta.decode_step_normed(q, k, v, a, b, gdn.A_log, gdn.dt_bias, state[1],
                                         inv, 1e-6)
    nq, nk = normalize_qk(q, k, inv_scale=inv, eps=1e-6)
    want = gated_delta.decode_step_ab(nq, nk, v, a, b, gdn.A_log, gdn.dt_bias, state[1])
    for x, w in zip(got, want):
        assert mx.allclose(x, w, atol=tol, rtol=tol).item()


def test_an_engine_on_a_model_another_engine_used_gets_its_own_settings(monkeypatch,
                                                                       arun):
    """A second Engine on the same model instance makes the compiled steps and kernels
    again for its settings (here: the short-conv kernels off) and reports what it
    made; the first engine's gate still holds the compiled path for its rows."""
    import gc

    from mlxnb.core.worker import qk_rope

    calls = _stand_ins(monkeypatch)
    from test_qk_rope import reference
    monkeypatch.setattr(qk_rope, "norm_rope", reference)
    model = build("qwen3_5", seed=5)
    setup = _load(model, arun)  # (its setup held: its gate stays live)
    status = setup.cache_kinds
    assert "(short conv: fused kernel)" in status
    assert "q/k norms and RoPE: fused kernel" in status
    monkeypatch.setenv("MLXNB_CONV_KERNEL", "0")
    monkeypatch.setenv("MLXNB_QK_ROPE", "0")
    _, _, status = prompts_through(model, arun)
    assert "short conv" not in status and "q/k norms" not in status
    assert "(gated delta: fused kernel, gates inside)" in status
    calls.clear()
    prompts_through(model, arun)
    assert [c for c in calls if c != "normed"] == []  # no conv kernel traced or run
    layer = next(layer for layer in model.layers if "linear_attn" in layer)
    assert not hasattr(type(layer.linear_attn), "_mlxnb_conv_base")
    assert not any(hasattr(type(m.self_attn), "_mlxnb_qk_base")
                   for m in model.layers if "self_attn" in m)
    # the first engine's gate came along: it still shuts the compiled path
    second = _load(model, arun)  # a live engine after the first is gone
    gates = layer._mlxnb_decode
    assert on_worker(gates.allowed)
    setup.decode_gate = lambda: False
    assert not on_worker(gates.allowed)
    del setup
    gc.collect()
    assert on_worker(gates.allowed)
    del second


def test_a_normalizing_kernel_that_disagrees_keeps_the_conv_kernels(monkeypatch, arun):
    """The load check tries the conv kernels with the gated delta kernel given the
    gates (q/k norms as MLX ops) before giving them up."""
    calls = _stand_ins(monkeypatch)
    good = gated_delta.decode_step_normed
    monkeypatch.setattr(gated_delta, "decode_step_normed",
                        lambda *a: tuple(x * 1.5 for x in good(*a)))
    model = build("qwen3_5", seed=5)
    status = prompts_through(model, arun)[2]
    assert "(gated delta: fused kernel) (short conv: fused kernel)" in status
    assert any(c != "normed" for c in calls)
