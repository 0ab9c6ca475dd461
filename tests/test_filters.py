"""The sampler's top-p and min-p filters: mlx-lm's `apply_top_p` and `apply_min_p`
bit for bit, and compiling no kernel on first use.

mlx-lm's filters are the reference (test_sampling.py draws against them); these
check that every logit the sampler's own filters give equals theirs, on rows made to
hit the edges: ties at the threshold (bfloat16 logits, where a vocabulary holds many
equal values), -inf entries (masked tokens), one token holding all the mass, top_p
at and around a cumulative mass, and top_p at the floor the sampler applies."""

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)
import io
import math
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_p

from mlxnb.core.worker.sampling import _MIN_TOP_P, _apply_filters, min_p_filter, top_p_filter


def _logprobs(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _rows(seed: int, dtype=mx.float32) -> mx.array:
    """[8, 4096] logprobs: rows of different spreads, one with masked tokens, one
    with a dominant token, one with every logit equal, one of few distinct values."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 4096)) * np.array([0.1, 1, 3, 8, 1, 1, 1, 1])[:, None]
    x[4, rng.random(4096) < 0.7] = -np.inf
    x[5, 17] = 40.0
    x[6] = 0.5
    x[7] = np.round(x[7] * 2) / 2  # a few dozen distinct values, thousands tied
    return _logprobs(mx.array(x.astype(np.float32)).astype(dtype))


def _same(a: mx.array, b: mx.array) -> bool:
    # bit for bit, -inf included (array_equal treats -inf == -inf)
    return a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_top_p_is_mlx_lms_bit_for_bit(seed, dtype):
    lp = _rows(seed, dtype)
    probs = np.sort(np.exp(np.array(lp.astype(mx.float32))), axis=-1)[:, ::-1]
    cum = np.cumsum(probs, axis=-1)
    # a spread of values and each row's own cumulative masses (exactly at a token's
    # boundary, where `>=` decides), the floor, and just under 1
    ps = [_MIN_TOP_P, 1e-6, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1 - 2 ** -24]
    ps += [float(c) for c in cum[:, [0, 1, 5, 100]].reshape(-1)]
    for p in ps:
        p = min(p, 1 - 2 ** -24)
        arr = mx.array(p, dtype=mx.float32)
        assert _same(top_p_filter(lp, arr), apply_top_p(lp, arr)), p


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_min_p_is_mlx_lms_bit_for_bit(dtype):
    lp = _rows(7, dtype)
    for p in (1e-9, 0.01, 0.05, 0.1, 1 / 3, 0.5, 0.9, 1.0):
        assert _same(min_p_filter(lp, p), apply_min_p(lp, p)), p


def test_the_filter_chain_keeps_mlx_lms_order():
    """top-p, then min-p, then top-k, as mlx-lm's make_sampler chains them."""
    from mlx_lm.sample_utils import apply_top_k
    lp = _rows(11)
    want = apply_top_k(apply_min_p(apply_top_p(lp, mx.array(0.8, dtype=mx.float32)), 0.02), 50)
    assert _same(_apply_filters(lp, 50, 0.8, 0.02), want)


def test_a_row_keeps_its_top_token_and_its_ties_whatever_the_filters():
    lp = _rows(5)
    top = mx.max(lp, axis=-1, keepdims=True)
    for out in (top_p_filter(lp, mx.array(_MIN_TOP_P, dtype=mx.float32)),
                min_p_filter(lp, 1.0)):
        kept = np.array(out) > -np.inf
        assert (kept == np.array(lp == top)).all()


def _primitives(outs) -> set:
    """The primitives of the graph that computes `outs` (MLX's DOT export)."""
    f = io.StringIO()
    mx.export_to_dot(f, *outs)
    return set(re.findall(r'label ="?([A-Za-z]+)', f.getvalue()))


# What MLX's CUDA backend compiles with NVRTC on first use, rather than ships built:
# fused (mx.compile'd) kernels, gathers and scatters. Sort, cumsum, reductions and
# elementwise ops are built (bench/results/first-token-2026-12-06-h100.md).
_JIT = ("Compiled", "Gather", "Scatter")


def test_the_filters_run_no_op_that_cuda_compiles_on_first_use():
    """On CUDA mlx-lm's compiled filters cost NVRTC compiles of seconds at a row's
    first token (a new fused kernel for each min_p value); the sampler's graph holds
    no such op. The control: mlx-lm's graph does, so the check can see one."""
    lp = _rows(1)
    p = mx.array(0.9, dtype=mx.float32)
    theirs = _primitives([apply_top_p(lp, p), apply_min_p(lp, 0.1)])
    assert any(op.startswith(_JIT) for op in theirs), theirs
    ours = _primitives([top_p_filter(lp, p), min_p_filter(lp, 0.1)])
    assert "Sort" in ours and not [op for op in ours if op.startswith(_JIT)], ours


def test_min_p_takes_any_value_as_mlx_lm_does():
    lp = _rows(3)
    for p in (math.ulp(0.0) * 1e6, 0.123456789):
        assert _same(min_p_filter(lp, p), apply_min_p(lp, p))
