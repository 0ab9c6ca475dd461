"""Fused q/k/v and gate/up projections (fuse.py): same outputs, same parameter bytes,
and groups whose parts see different inputs are left alone."""

import mlx.core as mx
import pytest
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxnb import Engine
from mlxnb.core.worker.fuse import fuse_projections
from mlxnb.models.tiny import tiny_model


def _probe(model):
    return lambda: model(mx.array([[0]]), cache=make_prompt_cache(model))


def _nbytes(model):
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _forward(model, x):
    cache = make_prompt_cache(model)
    out = [model(x, cache=cache)]
    for _ in range(3):
        out.append(model(out[-1][:, -1:].argmax(-1), cache=cache))
    return out


def test_fused_model_gives_the_same_logits():
    plain, _ = tiny_model(seed=3)
    fused, _ = tiny_model(seed=3)
    before = _nbytes(fused)
    assert fuse_projections(fused, _probe(fused)) == 2 * len(fused.layers)
    attn = fused.layers[0].self_attn
    assert "q_k_v_fused" in attn and "q_proj" not in attn
    assert "gate_up_fused" in fused.layers[0].mlp
    assert _nbytes(fused) == before
    x = mx.array([[5, 9, 20, 7, 7, 100], [1, 2, 3, 4, 5, 6]])
    for a, b in zip(_forward(plain, x), _forward(fused, x)):
        assert mx.allclose(a, b, atol=1e-4).item()


def test_quantized_projections_are_left_alone():
    model, _ = tiny_model(seed=3)
    nn.quantize(model, group_size=32, bits=4)
    x = mx.array([[5, 9, 20, 7]])
    want = _forward(model, x)
    assert fuse_projections(model, _probe(model)) == 0
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert "q_k_v_fused" not in model.layers[0].self_attn
    for a, b in zip(want, _forward(model, x)):
        assert mx.array_equal(a, b).item()


class _TwoInputs(nn.Module):
    """q from one input, k and v from another (cross-attention-like)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))

    def __call__(self, x, y):
        return self.q_proj(x) + self.k_proj(y) + self.v_proj(y)


def test_parts_called_on_different_inputs_stay_unfused():
    m = _TwoInputs()
    x, y = mx.ones((1, 8)), mx.arange(8, dtype=mx.float32)[None]
    want = m(x, y)
    assert fuse_projections(m, lambda: m(x, y)) == 0
    assert isinstance(m.q_proj, nn.Linear) and "q_k_v_fused" not in m
    assert mx.allclose(m(x, y), want).item()


def test_engine_fuses_unless_told_not_to(arun):
    async def run(fuse):
        model, tok = tiny_model(seed=5)
        eng = Engine((model, tok), kv_budget=None, fuse=fuse)
        r = await eng.submit("hello", chat=False, max_tokens=8)
        await eng.aclose()
        return r.tokens, "q_k_v_fused" in model.layers[0].self_attn

    (fused_tokens, fused), (plain_tokens, plain) = arun(run, True), arun(run, False)
    assert fused and not plain
    assert fused_tokens == plain_tokens


@pytest.mark.parametrize("family, owner, key, gone", [
    # a gated delta-net's four input projections; LFM2's w1/w3 MLP
    ("qwen3_5", lambda m: m.layers[0].linear_attn, "in_proj_fused", "in_proj_z"),
    ("lfm2", lambda m: m.layers[0].feed_forward, "w1_w3_fused", "w1"),
])
def test_hybrid_layers_projections_fuse_with_the_same_logits(family, owner, key, gone):
    from test_cache_kinds import build  # tests/ is on sys.path (pytest)
    mx.random.seed(4)  # what build leaves as initialised (a gated delta-net's A_log)
    plain = build(family, seed=4)
    mx.random.seed(4)
    fused = build(family, seed=4)
    before = _nbytes(fused)
    assert fuse_projections(fused, _probe(fused)) >= len(fused.layers)
    assert key in owner(fused) and gone not in owner(fused)
    assert _nbytes(fused) == before
    x = mx.array([[5, 9, 20, 7, 7, 100], [1, 2, 3, 4, 5, 6]])
    for a, b in zip(_forward(plain, x), _forward(fused, x)):
        assert mx.allclose(a, b, atol=1e-4).item()
