"""Compiled decode steps for recurrent layers (recurrent.py): which layers get them,
that decode runs through them with the same tokens as mlx-lm, and the cases that
must keep mlx-lm's plain code (a layer the trace cannot stand for, an adapter
selected, prefill)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from mlx_lm.generate import generate_step

from mlxnb import Engine
from mlxnb.core._threads import mlx_worker
from mlxnb.core.worker import recurrent
from mlxnb.core.worker.loadchecks import decode_steps_agree
from mlxnb.models.tiny import byte_tokenizer
from test_cache_kinds import PROMPTS, build, engine, prompts_through  # tests/ on sys.path


def _count_steps(model, mlps: bool = False):
    """Wrap every compiled layer's (or attention layer's MLP's) step to count its calls."""
    calls = [0]
    if mlps:
        sts = [(model.layers[i].get("mlp") or model.layers[i].get("feed_forward"))
               ._mlxnb_decode for i in recurrent.compiled_mlps(model)]
    else:
        sts = [model.layers[i]._mlxnb_decode for i in recurrent.compiled_layers(model)]
    for st in sts:
        step = st.step

        def counted(*a, _step=step):
            calls[0] += 1
            return _step(*a)
        st.step = counted
    return calls


def _mlx_lm_tokens(model, ids, n):
    cache = make_prompt_cache(model)
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                             prompt_cache=cache)]


@pytest.mark.parametrize("family,expect,mlps", [
    ("qwen3_5", [0, 2], [1, 3]), ("lfm2", [0, 2], [1, 3]), ("mamba2", [0, 1], []),
    ("llama", [], [])])
def test_recurrent_layers_decode_compiled_with_mlx_lm_tokens(family, expect, mlps, arun):
    """A hybrid model's attention layers keep mlx-lm's code but their MLPs decode
    compiled too."""
    model = build(family, seed=3)  # its own instance: the engine changes its layers

    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        calls, mlp_calls = _count_steps(model), _count_steps(model, mlps=True)
        rows = [eng.submit(p, max_tokens=10, chat=False) for p in PROMPTS]
        tokens = [(await r).tokens for r in rows]
        await eng.aclose()
        return tokens, [r.prompt_ids for r in rows], calls[0], mlp_calls[0]

    tokens, ids, calls, mlp_calls = arun(main)
    assert recurrent.compiled_layers(model) == expect
    assert recurrent.compiled_mlps(model) == mlps
    assert (calls > 0) == bool(expect)
    assert (mlp_calls > 0) == bool(mlps)
    plain = build(family, seed=3)  # the same weights, mlx-lm's own layers
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 10)


def test_every_other_caller_of_the_model_runs_mlx_lms_code(arun):
    """MLX keeps compiled traces per thread, keyed by the function's address, and
    forgets a freed function's traces on the thread that called it last only: steps
    called on two threads left traces that later steps at the same addresses
    replayed, and mlx-lm's generate on the main thread drew other tokens now and
    then. So compiled steps run for the engines' forwards on the worker alone: a
    forward from any other thread, or after every engine on the model is gone, is
    mlx-lm's own code."""
    import gc

    model = build("lfm2", seed=4)
    plain = build("lfm2", seed=4)
    ids = byte_tokenizer().encode("a prompt of some length")
    want = _mlx_lm_tokens(plain, ids, 8)

    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        calls, mlp_calls = _count_steps(model), _count_steps(model, mlps=True)
        here = _mlx_lm_tokens(model, ids, 8)  # the engine live, this thread
        seen = calls[0] + mlp_calls[0]
        await eng.submit(PROMPTS[0], max_tokens=4, chat=False)
        ran = calls[0] + mlp_calls[0] - seen
        await eng.aclose()
        del eng
        gc.collect()
        then = calls[0] + mlp_calls[0]
        on_thread = on_worker(lambda: _mlx_lm_tokens(model, ids, 8))  # none live
        return here, seen, ran, on_thread, calls[0] + mlp_calls[0] - then

    here, seen, ran, on_thread, after = arun(main)
    assert recurrent.compiled_layers(model) and recurrent.compiled_mlps(model)
    assert (seen, after) == (0, 0) and ran > 0
    assert here == on_thread == want


class _Counting(nn.Module):
    """A recurrent layer whose step depends on a Python counter: a trace bakes the
    counter's value in, so replays compute something else than the code says."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.t = 0

    def __call__(self, x, mask=None, cache=None):
        self.t += 1
        state = cache[0] if cache[0] is not None else mx.zeros((x.shape[0], 8))
        cache[0] = state * 0.5 + self.proj(x[:, -1]) * self.t
        return x + cache[0][:, None]


class _Toy(nn.Module):
    def __init__(self, layer_cls):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = [layer_cls(), layer_cls()]
        self.head = nn.Linear(8, 32)

    def __call__(self, ids, cache=None):
        h = self.embed(ids)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=None, cache=c)
        return self.head(h)

    def make_cache(self):
        return [ArraysCache(1) for _ in self.layers]


class _Pure(_Counting):
    def __call__(self, x, mask=None, cache=None):
        state = cache[0] if cache[0] is not None else mx.zeros((x.shape[0], 8))
        cache[0] = state * 0.5 + self.proj(x[:, -1])
        return x + cache[0][:, None]


def test_probe_keeps_plain_code_where_a_trace_would_differ(monkeypatch):
    import mlx_lm.models.cache as mc
    monkeypatch.setattr(mc, "make_prompt_cache", lambda m, *a: m.make_cache())
    import mlxnb.core.worker.loadchecks as loadchecks
    monkeypatch.setattr(loadchecks, "make_prompt_cache", lambda m, *a: m.make_cache())
    for cls, agree in ((_Pure, True), (_Counting, False)):
        mx.random.seed(0)
        toy = _Toy(cls)
        mx.eval(toy.parameters())
        live = [True]
        assert recurrent.compile_recurrent(toy, toy.make_cache(), lambda: live[0]) == 2
        why = decode_steps_agree(toy, list(range(2, 12)), live)
        assert (why == "") == agree, why
        if not agree:
            assert why == "compiled decode steps differ from the plain ones"
        recurrent.uncompile(toy)
        assert type(toy.layers[0]) is cls


def test_gate_and_prefill_take_the_plain_path():
    mx.random.seed(0)
    toy = _Toy(_Pure)
    mx.eval(toy.parameters())
    gate = [True]
    recurrent.compile_recurrent(toy, toy.make_cache(), lambda: gate[0])
    calls = _count_steps(toy)
    cache = toy.make_cache()
    toy(mx.array([[1, 2, 3]]), cache=cache)  # prefill: plain
    assert calls[0] == 0
    a = toy(mx.array([[4]]), cache=cache)  # decode: compiled
    assert calls[0] == 2
    gate[0] = False  # e.g. an adapter selected for this forward
    b = toy(mx.array([[5]]), cache=cache)
    assert calls[0] == 2
    mx.eval(a, b)


def test_mlp_prefill_and_closed_gate_take_the_plain_path():
    model = build("qwen3_5", seed=2)
    gate = [True]
    assert recurrent.compile_recurrent(model, make_prompt_cache(model), lambda: gate[0])
    assert recurrent.compiled_mlps(model) == [1, 3]
    calls = _count_steps(model, mlps=True)
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)  # prefill: plain
    assert calls[0] == 0
    a = model(mx.array([[4]]), cache=cache)  # decode: compiled, in both attention layers
    assert calls[0] == 2
    gate[0] = False
    b = model(mx.array([[5]]), cache=cache)
    assert calls[0] == 2
    mx.eval(a, b)
    recurrent.uncompile(model)
    assert recurrent.compiled_mlps(model) == recurrent.compiled_layers(model) == []


def test_layers_called_another_way_are_left_alone():
    class Odd(_Pure):
        def __call__(self, x, cache, extra=None):
            return super().__call__(x, cache=cache)

    class Model(_Toy):
        def __call__(self, ids, cache=None):
            h = self.embed(ids)
            for layer, c in zip(self.layers, cache):
                h = layer(h, c)
            return self.head(h)

    toy = Model(Odd)
    assert recurrent.compile_recurrent(toy, toy.make_cache(), lambda: True) == 0
    # a KV layer is never compiled
    toy2 = _Toy(_Pure)
    assert recurrent.compile_recurrent(toy2, [KVCache(), ArraysCache(1)], lambda: True) == 1
    assert recurrent.compiled_layers(toy2) == [1]


def test_engine_status_counts_compiled_layers(arun):
    eng = engine("qwen3_5")
    try:
        assert "2 recurrent-state + 2 attention layers, recurrent decode compiled" \
            in eng.status()
    finally:
        eng.close()


def test_compiled_recurrent_decode_can_be_turned_off(monkeypatch, arun):
    monkeypatch.setenv("MLXNB_COMPILE_RECURRENT", "0")
    eng = engine("qwen3_5")
    try:
        assert "recurrent decode compiled" not in eng.status()
    finally:
        eng.close()


def _gd_reference(q, k, v, g, beta, state):
    from mlx_lm.models.gated_delta import _gated_delta_step_ops
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv > Hk:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    y, st = _gated_delta_step_ops(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    return y[:, None], st


def test_gated_delta_kernel_gates_are_mlx_lms():
    """The gates the fused kernel computes from the raw projections (its formula in
    MLX ops) are mlx-lm's, over the range its projections take."""
    from mlx_lm.models.gated_delta import compute_g

    from mlxnb.core.worker import gated_delta
    mx.random.seed(0)
    a = mx.random.normal((3, 1, 8)) * 8
    b = mx.random.normal((3, 1, 8)) * 8
    A_log, dt_bias = mx.random.normal((8,)), mx.random.normal((8,))
    g, beta = gated_delta.gates(a, b, A_log, dt_bias)
    assert mx.allclose(g, compute_g(A_log, a, dt_bias), rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(beta, mx.sigmoid(b), rtol=1e-5, atol=1e-6).item()


def test_gated_delta_update_is_wrapped_only_in_kernel_traces(monkeypatch):
    """In a "gates" trace, a one-token update with plain gates goes to the
    gates-inside kernel; anything else (a mask, a lower bound, no trace) to mlx-lm."""
    import sys

    from mlx_lm.models import gated_delta as gd
    from mlx_lm.models import qwen3_5  # noqa: F401  (a module that imports it by name)

    from mlxnb.core.worker import gated_delta
    seen = []
    monkeypatch.setattr(gated_delta, "decode_step_ab",
                        lambda *a: seen.append("ab") or ("y", "state"))
    monkeypatch.setattr(gated_delta, "decode_step",  # gates given (mlx-lm's)
                        lambda *a: seen.append("given") or ("y", "state"))
    monkeypatch.setattr(sys.modules["mlx_lm.models.qwen3_5"], "gated_delta_update",
                        gd.gated_delta_update)
    gated_delta.install()
    update = sys.modules["mlx_lm.models.qwen3_5"].gated_delta_update
    assert update is not gd.gated_delta_update and update._mlxnb
    q, k = mx.zeros((2, 1, 2, 32)), mx.zeros((2, 1, 2, 32))
    v, a, b = mx.zeros((2, 1, 4, 8)), mx.zeros((2, 1, 4)), mx.zeros((2, 1, 4))
    A_log, dt, st = mx.zeros((4,)), mx.zeros((4,)), mx.zeros((2, 4, 8, 32))
    with gated_delta.tracing("gates"):
        assert update(q, k, v, a, b, A_log, dt, st) == ("y", "state")
        assert update(q, k, v, a, b, A_log, dt, st, lower_bound=-5.0) == ("y", "state")
        out = update(q, k, v, a, b, A_log, dt, st, mask=mx.ones((2, 1), mx.bool_))
        assert out[0].shape == (2, 1, 4, 8)
    update(q, k, v, a, b, A_log, dt, st)  # not in a trace
    assert seen == ["ab", "given"]


@pytest.mark.parametrize("broken", ["", "gates", "both"])
def test_gated_delta_kernel_path_is_checked_and_keeps_tokens(broken, monkeypatch, arun):
    """On a CUDA-like backend the compiled gated delta-net steps run the recurrence
    as gated_delta.py's kernel (its stand-in here: the same step in MLX ops, counted),
    the gates computed inside; one that disagrees is caught at load and the kernel
    given the gates takes over, and where that disagrees too, MLX's fused op."""
    from mlxnb.core.worker import gated_delta, kv_attention
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    calls = []

    def kernel(q, k, v, g, beta, state, bad=broken == "both"):
        calls.append(q.shape)
        y, st = _gd_reference(q, k, v, g, beta, state)
        return (y * 1.5 if bad else y), st

    def kernel_ab(q, k, v, a, b, A_log, dt_bias, state):
        return kernel(q, k, v, *gated_delta.gates(a, b, A_log, dt_bias), state,
                      bad=bool(broken))

    monkeypatch.setattr(gated_delta, "decode_step", kernel)
    monkeypatch.setattr(gated_delta, "decode_step_ab", kernel_ab)
    model = build("qwen3_5", seed=5)
    tokens, ids, status = prompts_through(model, arun)
    want = {"": "(gated delta: fused kernel, gates inside)",
            "gates": "(gated delta: fused kernel)", "both": "(gated delta: mx.fast)"}[broken]
    assert f"recurrent decode compiled {want}" in status
    assert calls  # the kernel was traced (and checked) at least once
    plain = build("qwen3_5", seed=5)
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 8)


def test_a_closed_engines_gate_goes_with_it():
    import gc

    class Owner:
        def __init__(self):
            self.ok = True

        def recurrent_ok(self):
            return self.ok

    mx.random.seed(0)
    toy = _Toy(_Pure)
    a, b = Owner(), Owner()
    recurrent.compile_recurrent(toy, toy.make_cache(), a.recurrent_ok)
    recurrent.compile_recurrent(toy, toy.make_cache(), b.recurrent_ok)
    st = toy.layers[0]._mlxnb_decode
    assert len(st.gates) == 2
    a.ok = False  # any live engine's gate closes the compiled path
    assert not st.allowed()
    del a
    gc.collect()
    assert st.allowed()
    recurrent.compile_recurrent(toy, toy.make_cache(), Owner().recurrent_ok)
    assert len(st.gates) == 2  # the dead one pruned, b's and the newest kept (b alive)


def test_quantized_hybrid_model_decodes_compiled_with_mlx_lm_tokens(arun):
    model = build("qwen3_5", seed=6)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())  # (the engine's worker thread cannot evaluate them)

    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        rows = [eng.submit(p, max_tokens=8, chat=False) for p in PROMPTS[:2]]
        tokens = [(await r).tokens for r in rows]
        await eng.aclose()
        return tokens, [r.prompt_ids for r in rows]

    tokens, ids = arun(main)
    assert recurrent.compiled_layers(model) == [0, 2]
    assert recurrent.compiled_mlps(model) == [1, 3]
    plain = build("qwen3_5", seed=6)
    nn.quantize(plain, group_size=32, bits=4)
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 8)


def on_worker(fn):
    """fn() on the MLX worker, the one thread an engine's gate opens for."""
    return mlx_worker().submit(fn).result()


def _load(model, arun):
    """An Engine's BatchModel on `model` (the engine closed, the BatchModel held: its
    gate stays live)."""
    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        setup = eng._exec.setup
        await eng.aclose()
        return setup
    return arun(main)


def test_an_engine_that_compiled_nothing_still_gates_the_compiled_steps(monkeypatch, arun):
    """Another engine's compiled steps are shut while this engine's adapter rows run,
    though this engine compiled nothing itself."""
    import gc

    model = build("qwen3_5", seed=5)
    monkeypatch.setenv("MLXNB_COMPILE_RECURRENT", "0")
    first = _load(model, arun)
    assert recurrent.compiled_layers(model) == []
    monkeypatch.delenv("MLXNB_COMPILE_RECURRENT")
    second = _load(model, arun)
    gates = model.layers[recurrent.compiled_layers(model)[0]]._mlxnb_decode
    assert on_worker(gates.allowed)
    first.decode_gate = lambda: False  # (an adapter selected on the first engine)
    assert not on_worker(gates.allowed)
    del first
    gc.collect()
    assert on_worker(gates.allowed)
    del second
    gc.collect()
    assert not on_worker(gates.allowed)  # no engine left: mlx-lm's own code again


def test_a_load_that_fails_midway_leaves_no_steps_ungated(monkeypatch, arun):
    from mlxnb.core.worker.setup import BatchModel

    model = build("qwen3_5", seed=5)
    held = _load(model, arun)
    assert recurrent.compiled_layers(model)

    def fails(self):
        raise MemoryError("out of memory")
    monkeypatch.setattr(BatchModel, "_adopt_qk_rope", fails)
    with pytest.raises(Exception):
        _load(model, arun)
    assert recurrent.compiled_layers(model) == []  # plain code, not steps nobody gates
    del held


def test_an_earlier_engines_status_says_a_later_one_set_the_layers_up_again(arun):
    """Each load sets a model instance's layers up for its own settings, so an
    earlier live engine's line names what it loaded, and says so."""
    model = build("lfm2", seed=2)
    note = "a later Engine load on this model object has set its layers up again"

    async def main():
        first = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        alone = first.status()
        second = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        lines = first.status(), second.status()
        await first.aclose()
        await second.aclose()
        return alone, lines

    alone, (first, second) = arun(main)
    assert note not in alone and note in first and note not in second
    assert "recurrent decode compiled" in first and "recurrent decode compiled" in second


@pytest.mark.parametrize("where", ["padding_stays_out", "BatchModel._adopt_qk_rope"])
def test_a_later_load_that_fails_still_marks_the_earlier_status(where, monkeypatch, arun):
    """Fused projections, compiled steps and kernels change from the load's start."""
    import mlxnb.core.worker.setup as setup

    model = build("lfm2", seed=2)

    def boom(*a):
        raise RuntimeError("a load check failed")

    async def main():
        first = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        owner, _, name = where.rpartition(".")
        monkeypatch.setattr(getattr(setup, owner) if owner else setup, name, boom)
        with pytest.raises(RuntimeError):
            Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        line = first.status()
        await first.aclose()
        return line

    assert "has set its layers up again since" in arun(main)
