"""own_kernels.py: this package's CUDA kernels, run on zeros at each layer's sizes while
the model's kernels compile in helpers. On the CPU nothing compiles; these tests tie
each guess to what the load's own checks and steps give the kernels."""

import mlx.core as mx
import pytest

from mlxnb.core.worker import caches, kv_attention, own_kernels, qk_rope, short_conv
from mlxnb.core.worker.caches import empty_batch, make_row_cache
from mlxnb.core.worker.tokens import TOKEN
from zoo import build  # tests/ is on sys.path (pytest)

FAMILIES = ("llama", "lfm2", "qwen3_5", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def member(request):
    m = build(request.param)
    if m.model is None:
        pytest.skip(m.reason)
    return m


def found(model, finder):
    return {k[1:] for k in own_kernels.calls(model) if k[0] == finder}


def test_the_attention_guess_is_what_the_load_check_records(member, monkeypatch):
    # setup.py's decode attention check records (Hq, Hkv, D, dtypes, scale) from a
    # padded batch's decode and compiles the kernel at those: the guess must be them
    model = member.model
    guess = found(model, "_attention")
    kv_attention.install()
    monkeypatch.setattr(caches.LeanBatchKVCache, "dense_decode", True)
    with kv_attention.recording(dense=True) as calls:
        cache = empty_batch(make_row_cache(model), 1)
        model(mx.zeros((1, 3), TOKEN), cache=cache)
        mx.eval(model(mx.zeros((1, 1), TOKEN), cache=cache))
    assert calls, "no full-attention layer decoded"
    assert guess == {(Hq, Hkv, D, qdt, scale) for Hq, Hkv, D, qdt, kdt, scale in calls}
    assert all(qdt == kdt for _, _, _, qdt, kdt, _ in calls)  # (one dtype in the key)


def test_the_qk_guess_is_each_adopted_layers(member, monkeypatch):
    # qk_rope.self_check runs the kernel at each adopted module's sizes
    model = member.model
    guess = found(model, "_qk")
    monkeypatch.setattr(qk_rope, "wanted", lambda: True)  # (as on CUDA)
    if not qk_rope.adopt(model, lambda: True):
        assert guess == set()
        return
    try:
        want = set()
        for m in qk_rope._adopted(model):
            form = m._mlxnb_qk_form
            qn = m[form.norms[0]]
            H, HK = (getattr(m, n) for n in form.heads)
            want.add((H, HK, qn.weight.shape[0], m.rope.dims, form.plus_one,
                      qn.weight.dtype))
    finally:
        qk_rope.release(model)
    assert want and guess == want


def test_the_conv_guess_is_what_the_steps_kernel_takes(member):
    # the one-token steps take the kernel only for inputs `_fits` accepts, and the
    # kernel is named by (dtype, C, L)
    model = member.model
    calls = {k: c for k, c in own_kernels.calls(model).items() if k[0] == "_conv"}
    kinds = [short_conv._kind(m) for _, m in model.named_modules()]
    assert {k[1] for k in calls} == {k for k in kinds if k}
    for (_, kind, C, L, dt), call in calls.items():
        x, state, w = call.args
        assert short_conv._fits(x, state, w) and w.shape[:2] == (C, L) and x.dtype == dt
        assert x.shape[-1] == (3 * C if kind == "gated" else C)


def test_nothing_runs_off_cuda_or_for_quantized_kv(member, monkeypatch):
    assert own_kernels.warm(member.model) == 0  # (the CPU: no kernel of ours)
    assert all(k[0] != "_attention" for k in own_kernels.calls(member.model, kv_bits=4))
