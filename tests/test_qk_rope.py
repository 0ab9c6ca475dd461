"""One-token q/k norms and RoPE in one kernel (qk_rope.py): which attention calls take
it, that the one-token call around it is mlx-lm's, and that a kernel that disagrees is
caught at load. Off CUDA the kernel is stood in for by its math in MLX ops; the CUDA
kernel itself is checked against mlx-lm's ops where the backend has it."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxnb import Engine
from mlxnb.core.worker import kv_attention, qk_rope
from mlxnb.models.tiny import byte_tokenizer
from test_cache_kinds import alone_then_joining, build, prompts_through  # tests/ on path
from test_recurrent import _mlx_lm_tokens


def reference(q, k, qw, kw, q_eps, k_eps, offset, scale, base, dims, plus_one=False):
    """The kernel's math in MLX ops: mlx-lm's norms, then its RoPE."""
    def one(x, w, eps):
        w = 1.0 + w if plus_one else w
        x = mx.fast.rms_norm(x, w, eps).transpose(0, 2, 1, 3)
        return mx.fast.rope(x, dims, traditional=False, base=base, scale=scale,
                            offset=offset)
    return one(q, qw, q_eps), one(k, kw, k_eps)


def _attention(model):
    return next(layer.self_attn for layer in model.layers if "self_attn" in layer)


def _stand_in(monkeypatch, broken=False):
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    calls = []

    def kernel(*a):
        calls.append(a[6])
        qo, ko = reference(*a)
        return (qo * 1.5 if broken else qo), ko
    monkeypatch.setattr(qk_rope, "norm_rope", kernel)
    return calls


@pytest.mark.parametrize("family", ["lfm2", "qwen3", "qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("broken", [False, True])
def test_attention_takes_the_kernel_checked_at_load(family, broken, monkeypatch, arun):
    """LFM2's, Qwen3's, Qwen3.5's (gated queries, RoPE on a quarter of each head) and
    Gemma 3's (norms scaled by 1 + weight, sliding windows) attention take the kernel
    (its stand-in here) with mlx-lm's tokens; one that disagrees is caught by the load
    check and the modules keep mlx-lm's code."""
    calls = _stand_in(monkeypatch, broken)
    mx.random.seed(6)
    model = build(family, seed=6)

    n0 = len(calls)
    tokens, ids, status = prompts_through(model, arun)
    assert calls and len(calls) > n0
    assert ("q/k norms and RoPE: fused kernel" in status) is not broken
    attn = [type(layer.self_attn) for layer in model.layers if "self_attn" in layer]
    assert attn and all(hasattr(a, "_mlxnb_qk_base") is not broken for a in attn)
    # rows that joined at different times decode padded: per-row positions
    assert any(isinstance(c, mx.array) and c.size > 1 for c in calls) or broken
    mx.random.seed(6)
    plain = build(family, seed=6)
    for t, i in zip(tokens, ids):
        assert t == _mlx_lm_tokens(plain, i, 8)


def test_other_threads_forwards_keep_mlx_lms_code(monkeypatch, arun):
    """The kernel is for the engines' forwards on the worker: a forward of the same
    model on another thread, the engine live, runs mlx-lm's norms and RoPE."""
    calls = _stand_in(monkeypatch)
    model = build("qwen3", seed=4)
    ids = byte_tokenizer().encode("a prompt of some length")
    want = _mlx_lm_tokens(build("qwen3", seed=4), ids, 6)

    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None)
        n = len(calls)
        here = _mlx_lm_tokens(model, ids, 6)
        seen = len(calls) - n
        await eng.submit("x", max_tokens=4, chat=False)
        ran = len(calls) - n - seen
        await eng.aclose()
        return here, seen, ran

    here, seen, ran = arun(main)
    assert (seen, here) == (0, want) and ran > 0


def test_only_one_token_calls_with_the_gate_open_take_it(monkeypatch):
    calls = _stand_in(monkeypatch)
    model = build("lfm2")
    attn = _attention(model)
    D = attn.q_proj.weight.shape[1]
    gate = [True]

    class Engine:
        def ok(self):
            return gate[0]
    owner = Engine()
    assert qk_rope.adopt(model, owner.ok) == 2
    x1, x3 = mx.random.normal((2, 1, D)), mx.random.normal((2, 3, D))

    def run(x, cache=None):
        cache = cache or KVCache()
        return attn(x, cache=cache), cache

    run(x3)  # a prefill chunk
    attn(x1)  # no cache
    gate[0] = False
    run(x1)
    assert calls == []
    gate[0] = True
    _, cache = run(x3)
    got, _ = run(x1, cache)
    assert calls == [3]
    gate[0] = False
    c2 = KVCache()
    run(x3, c2)
    want, _ = run(x1, c2)
    assert mx.allclose(got, want, atol=1e-5).item()
    qk_rope.release(model)
    assert not hasattr(type(attn), "_mlxnb_qk_base")
    del owner  # a gone engine's gate no longer holds the path shut
    gate[0] = False


def test_the_kernel_is_for_cuda_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: False)
    assert qk_rope.adopt(build("lfm2"), lambda: True) == 0
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    monkeypatch.setenv("MLXNB_QK_ROPE", "0")
    assert qk_rope.adopt(build("lfm2"), lambda: True) == 0


def test_other_attentions_keep_mlx_lms_code(monkeypatch):
    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    assert qk_rope.adopt(build("llama"), lambda: True) == 0  # no q/k norms
    model = build("lfm2")
    _attention(model).rope.traditional = True
    assert qk_rope.adopt(model, lambda: True) == 1  # the other layer


@pytest.mark.skipif(not kv_attention.cuda_backend(), reason="the CUDA kernel needs CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,per_row,D,dims", [(1, False, 64, 64), (5, True, 64, 64),
                                             (64, False, 128, 128), (3, True, 256, 64),
                                             (2, False, 16, 8)])
@pytest.mark.parametrize("plus_one", [False, True])
def test_the_cuda_kernel_is_mlx_lms_norms_and_rope(dtype, B, per_row, D, dims, plus_one):
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    mx.random.seed(B)
    H, HK = 8, 2
    qkv = mx.random.normal((B, 1, (H + 2 * HK) * D)).astype(dtype)  # strided slices
    q = qkv[..., :H * D].reshape(B, 1, H, D)
    k = qkv[..., H * D:(H + HK) * D].reshape(B, 1, HK, D)
    qw, kw = (1 + 0.1 * mx.random.normal((2, D))).astype(dtype)
    off = mx.array([3, 70, 1000, 5, 9][:B], mx.int32) if per_row else 4000
    args = (q, k, qw, kw, 1e-5, 1e-6, off, 1.0, 1e6, dims, plus_one)
    for got, want in zip(qk_rope.norm_rope(*args), reference(*args)):
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=tol, rtol=tol).item()


@pytest.mark.parametrize("family,kv", [("lfm2", dict(kv_bits=8, kv_group_size=32)),
                                       ("qwen3", dict(kv_bits=4, kv_group_size=32)),
                                       ("qwen3", {}), ("gemma3_text", {}),
                                       ("gemma3_text", dict(kv_bits=8, kv_group_size=32))])
def test_rows_joining_a_running_batch_keep_mlx_lms_tokens(family, kv, monkeypatch, arun):
    """Through the kernel path (its stand-in), rows alone, prefilled as a padded group
    and joining the running batch, on full-precision and quantized KV, give
    mlx-lm's own tokens."""
    from mlx_lm.generate import generate_step

    from mlxnb.core.worker.caches import make_row_cache

    calls = _stand_in(monkeypatch)
    mx.random.seed(7)
    model = build(family, seed=7)
    n = 12
    alone, batched, ids = arun(lambda: alone_then_joining(
        Engine((model, byte_tokenizer()), warmup=False, kv_budget=None, **kv), n))
    assert calls and batched == alone
    mx.random.seed(7)
    plain = build(family, seed=7)
    for t, i in zip(alone, ids):
        cache = make_row_cache(plain, kv.get("kv_bits"), kv.get("kv_group_size", 64))
        want = [int(x) for x, _ in generate_step(mx.array(i), plain, max_tokens=n,
                                                 prompt_cache=cache)]
        assert t == want


def test_a_kernel_wrong_only_for_per_row_positions_is_caught_at_load(monkeypatch, arun):
    """The load's decode check runs one position for all rows; the self-check runs
    one per row too."""
    _stand_in(monkeypatch)
    good = qk_rope.norm_rope

    def first_row_only(q, k, qw, kw, qe, ke, offset, *a):
        if isinstance(offset, mx.array) and offset.size > 1:
            offset = offset.reshape(-1)[:1]
        return good(q, k, qw, kw, qe, ke, offset, *a)
    monkeypatch.setattr(qk_rope, "norm_rope", first_row_only)
    model = build("lfm2", seed=8)
    tokens, ids, status = prompts_through(model, arun)
    assert "q/k norms and RoPE: MLX's (kernel differs from MLX's norms and RoPE)" in status
    assert not any(hasattr(type(layer.get("self_attn")), "_mlxnb_qk_base")
                   for layer in model.layers)


def test_the_adopted_modules_keep_their_tree(monkeypatch):
    from mlx.utils import tree_flatten

    monkeypatch.setattr(kv_attention, "cuda_backend", lambda: True)
    model = build("qwen3_5")
    before = [k for k, _ in tree_flatten(model)]
    assert qk_rope.adopt(model, lambda: True)
    assert [k for k, _ in tree_flatten(model)] == before
    qk_rope.release(model)
    assert [k for k, _ in tree_flatten(model)] == before


def test_gemma_norm_weights_changed_in_place_are_seen(monkeypatch):
    """The kernel takes Gemma's weights as they are at each call (1 + weight inside),
    so a weight changed in place changes the output as it does mlx-lm's."""
    calls = _stand_in(monkeypatch)
    model = build("gemma3_text", seed=5)
    attn = _attention(model)
    assert qk_rope.adopt(model, lambda: True) >= 1
    width = attn.q_proj.weight.shape[1]
    x3, x1 = mx.random.normal((2, 3, width)), mx.random.normal((2, 1, width))
    caches = [KVCache(), KVCache()]
    for c in caches:
        attn(x3, cache=c)  # a prefill chunk: mlx-lm's code
    assert calls == []
    attn.q_norm.weight += 0.4
    got = attn(x1, cache=caches[0])
    assert calls == [3]
    qk_rope.release(model)
    want = attn(x1, cache=caches[1])
    assert mx.allclose(got, want, atol=1e-5).item()
