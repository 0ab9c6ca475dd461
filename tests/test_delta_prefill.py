"""gated_delta_prefill.py: a delta-net's recurrence over a chunk in one CUDA kernel.

The kernel itself runs on CUDA only (bench/device runs compare it with mlx-lm's ops).
Here: its load check's reference is mlx-lm's ops bit for bit; the check passes the
kernel's math (a stand-in in MLX ops, y = 0 where masked, as the kernel writes it)
and catches a kernel that is wrong in any one way; an engine's forwards take it on
the engine's worker only, with mlx-lm's tokens; and a load that takes it records no
call of mlx-lm's per-token step, so no helper compiles one."""

import threading

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as gd

from mlxnb.core.worker import calls_ahead, gated_delta, gated_delta_prefill as gdp, own_kernels
from mlxnb.core.worker.caches import make_row_cache
from mlxnb.core.worker.loadchecks import load_forwards
from test_cache_kinds import prompts_through  # tests/ is on sys.path (pytest)
from test_recurrent import _mlx_lm_tokens
from zoo import build

KEY = ("bfloat16", 2, 4, 64, 32)  # (dtype, Hk, Hv, Dk, Dv): two value heads per key head


def qwen(seed=0):
    """A tiny Qwen3.5 whose delta-nets the kernel takes (a key row a warp wide)."""
    return build("qwen3_5", seed=seed, linear_key_head_dim=32).model


def _layer_params(seed=0):
    ks = mx.random.split(mx.random.key(seed))
    return mx.random.normal((4,), key=ks[0]), mx.random.normal((4,), key=ks[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("state", [True, False])
def test_the_reference_is_mlx_lms_ops_bit_for_bit(dtype, masked, state):
    args = list(gdp._inputs((dtype,) + KEY[1:], *_layer_params()))
    if not masked:
        args[-1] = None
    if not state:
        args[-2] = None
    want = gd.gated_delta_update(*args, use_kernel=False)
    got = gdp.reference(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item()


def kernel_math(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    """What the kernel computes, in MLX ops: mlx-lm's, with y = 0 at masked tokens."""
    y, s = gdp.reference(q, k, v, a, b, A_log, dt_bias, state, mask)
    if mask is not None:
        y = mx.where(mask[..., None, None], y, mx.zeros_like(y))
    return y, s


def _no_mask_for_state(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    y, s = gdp.reference(q, k, v, a, b, A_log, dt_bias, state, None)
    return (y if mask is None else mx.where(mask[..., None, None], y, 0).astype(y.dtype)), s


def _wrong_head(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    # value head h reads key head h % Hk instead of h // (Hv / Hk)
    Hk, Hv = q.shape[2], v.shape[2]
    q, k = (mx.concatenate([x] * (Hv // Hk), axis=2) for x in (q, k))
    return kernel_math(q, k, v, a, b, A_log, dt_bias, state, mask)


def _beta_unsquashed(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    return kernel_math(q, k, v, a, mx.log(mx.sigmoid(b)) + 1e-3 * b, A_log, dt_bias, state,
                       mask)


@pytest.fixture
def offered(monkeypatch):
    """gated_delta_prefill as on CUDA, the kernel a stand-in; `use(fn)` returns the
    list of (sizes, tokens, masked) of the forwards' calls that took it (the check's
    own calls not among them). The thread's offer and the hook are undone after."""
    monkeypatch.setattr(gdp, "wanted", lambda: True)
    monkeypatch.setattr(gated_delta, "PREFILL", [None])
    calls = []
    route = gdp._route

    def counted(q, k, v, a, b, A_log, dt_bias, state, mask):
        out = route(q, k, v, a, b, A_log, dt_bias, state, mask)
        if out is not None:
            calls.append((gdp._key(q, v), q.shape[1], mask is not None))
        return out

    monkeypatch.setattr(gdp, "_route", counted)

    def use(fn):
        monkeypatch.setattr(gdp, "prefill", fn)
        return calls

    yield use
    gdp._LOCAL.keys = set()


def test_the_check_passes_the_kernels_math(offered):
    model = qwen()
    offered(kernel_math)
    assert gdp.offer(model) == 1
    assert gdp.check(model) == "" and gdp.taken(model)


@pytest.mark.parametrize("flaw", [gdp.reference, _no_mask_for_state, _wrong_head,
                                  _beta_unsquashed])
def test_the_check_catches_a_kernel_wrong_in_one_way(flaw, offered):
    model = qwen()
    offered(flaw)
    gdp.offer(model)
    assert gdp.check(model) == "kernel differs from mlx-lm's ops"
    assert not gdp.taken(model)


@pytest.mark.parametrize("stand_in,family", [(kernel_math, "qwen3_5"),
                                             (kernel_math, "qwen3_next"),
                                             (_no_mask_for_state, "qwen3_5")])
def test_an_engine_prefills_through_it_with_mlx_lms_tokens(stand_in, family, offered, arun):
    """Padded groups, rows joining, decode: the engine's tokens are mlx-lm's. With a
    kernel that lets padding into the state, the load check turns it off first."""
    calls = offered(stand_in)
    mx.random.seed(5)
    model = build(family, seed=5, linear_key_head_dim=32).model
    tokens, ids, status = prompts_through(model, arun)
    good = stand_in is kernel_math
    assert ("delta-net prefill: fused kernel" in status) is good, status
    if good:
        # whole chunks, padded ones among them, and one-token plain forwards
        assert any(T > 1 and masked for _, T, masked in calls)
        assert any(T > 1 and not masked for _, T, masked in calls)
        assert any(T == 1 for _, T, _ in calls)
        # the sizes the route met are those own_kernels compiles ahead
        ahead = {k[1:6] for k in own_kernels.calls(model) if k[0] == "_delta"}
        assert {key for key, _, _ in calls} == ahead != set()
    else:
        assert "delta-net prefill: mlx-lm's (kernel differs" in status
    mx.random.seed(5)
    plain = build(family, seed=5, linear_key_head_dim=32).model
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 8)


def test_only_the_offering_threads_forwards_take_it(offered):
    calls = offered(kernel_math)
    model = qwen()
    gdp.offer(model)
    x = mx.zeros((1, 4), mx.uint32)
    mx.eval(model(x, cache=make_row_cache(model)))
    here = len(calls)
    assert here > 0
    t = threading.Thread(target=lambda: mx.eval(model(x, cache=make_row_cache(model))))
    t.start()
    t.join()
    assert len(calls) == here


def test_a_load_that_takes_it_leaves_no_per_token_step_to_compile(offered):
    """The survey of the load's forwards (calls_ahead.py) records mlx-lm's step and
    gates when the load runs mlx-lm's loop, and neither when the kernel is offered:
    no helper compiles them, which was a fresh CUDA machine's longest wait."""
    offered(kernel_math)
    model = qwen()

    def recorded():
        groups = calls_ahead.survey(load_forwards(model, lambda: make_row_cache(model),
                                                  list(range(3, 20))))
        return {g[0]["name"] for g in groups}

    gdp._LOCAL.keys = set()
    assert {"_gated_delta_step_ops", "compute_g"} <= recorded()
    gdp.offer(model)
    assert not {"_gated_delta_step_ops", "compute_g"} & recorded()


def test_sizes_it_cannot_take_are_left_to_mlx_lm(offered):
    offered(kernel_math)
    assert gdp.offer(build("qwen3_5").model) == 0  # 16-wide key rows
    assert gdp.offer(qwen()) == 1
    # Qwen3-Next's delta-net (its own class name) too
    assert gdp.offer(build("qwen3_next", linear_key_head_dim=32).model) == 1


def _one_token_off(q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    y, s = kernel_math(q, k, v, a, b, A_log, dt_bias, state, mask)
    return (y * 1.5 if q.shape[1] == 1 else y), s


def test_the_decode_check_compares_with_mlx_lms_math_not_the_kernel(offered, arun):
    """A kernel wrong for one-token calls only passes the prefill check (chunks of
    six); the decode check's plain side must still be mlx-lm's math, which the
    compiled steps match: the engine compiles its recurrent decode."""
    calls = offered(_one_token_off)
    model = qwen(5)
    _, _, status = prompts_through(model, arun)
    assert "delta-net prefill: fused kernel" in status
    assert "recurrent decode compiled" in status, status
    assert calls


def test_a_training_forward_keeps_mlx_lms_code(offered):
    calls = offered(kernel_math)
    model = qwen()
    gdp.offer(model)
    import sys
    mod = sys.modules[type(next(m for _, m in model.named_modules()
                                if gdp.layer_key(m))).__module__]
    args = gdp._inputs(("float32", 2, 4, 32, 16), *_layer_params())
    mod.gated_delta_update(*args, use_kernel=False)
    assert calls == []
    mod.gated_delta_update(*args)
    assert len(calls) == 1


def test_it_can_be_turned_off(monkeypatch):
    from mlxnb.core.worker import kv_attention
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    monkeypatch.setenv("MLXNB_DELTA_PREFILL", "0")
    assert not gdp.wanted()
    monkeypatch.setenv("MLXNB_DELTA_PREFILL", "1")
    assert gdp.wanted()


def test_another_engines_load_on_the_worker_keeps_its_sizes(offered):
    """The worker thread is one per process, shared by engines: loading a model with
    no delta-net, or with others, leaves the sizes an earlier engine checked."""
    offered(kernel_math)
    model = qwen()
    gdp.offer(model)
    assert gdp.check(model) == ""
    other = build("llama").model
    assert gdp.offer(other) == 0 and gdp.check(other) == ""
    wider = build("qwen3_5", linear_key_head_dim=64).model
    assert gdp.offer(wider) == 1 and gdp.check(wider) == ""
    assert gdp.taken(model) and gdp.taken(wider)
