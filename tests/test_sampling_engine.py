"""Sampling through the engine, on tiny random-weight models.

The constrained and top-k rows run on the tiny model with the real 49152-token
vocabulary: a sampler that drew a random vocabulary token once in 2**24 noise values
would do so about once in 341 draws there, and a random model leaves nothing but
the mask and the filters between a row and such a token.
"""

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_k

from mlxnb import Engine
from mlxnb.core.constraint_params import kind_of

REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe later"]
LABEL = {"type": "object", "properties": {"label": {"enum": ["pos", "neg", "neutral"]},
                                          "score": {"type": "integer", "minimum": 1,
                                                    "maximum": 5}},
         "required": ["label", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny49k():
    from mlxnb.models.tiny import tiny_model

    return tiny_model(vocab="smollm2")


def make(model, **kw):
    return Engine(model, kv_budget=None, warmup=False, **kw)


def test_256_sampled_constrained_rows_never_fail_and_every_stopped_row_is_valid(tiny49k, arun):
    async def main():
        eng = make(tiny49k, max_batch=256)
        rows = []
        for i in range(256):
            kind = ("regex", "choices", "json_schema")[i % 3]
            value = {"regex": REGEX, "choices": CHOICES, "json_schema": LABEL}[kind]
            rows.append(eng.submit(f"row {i}:", chat=False, max_tokens=24, seed=i,
                                   temperature=(0.8, 1.5)[i % 2], **{kind: value}))
        await eng.wait()
        await eng.aclose()
        return rows

    rows = arun(main, timeout=120)
    errors = [(r.params.seed, r.error) for r in rows if r.finish_reason == "error"]
    assert not errors, f"{len(errors)} rows failed, e.g. {errors[:3]}"
    for r in rows:
        assert r.finish_reason in ("stop", "length"), (r.params.seed, r.finish_reason)
        if r.finish_reason == "stop":
            assert r.valid and r.constraint_error is None, (kind_of(r.params), r.text)
    # the constraints are what end these rows
    assert sum(r.finish_reason == "stop" for r in rows) >= 200


def test_top_k_1_is_greedy_for_256_seeded_rows(tiny49k, arun):
    async def main():
        eng = make(tiny49k, max_batch=512)
        greedy = [eng.submit(f"row {i}", chat=False, max_tokens=12) for i in range(256)]
        top1 = [eng.submit(f"row {i}", chat=False, max_tokens=12, temperature=1.0,
                           top_k=1, seed=i) for i in range(256)]
        await eng.wait()
        await eng.aclose()
        return greedy, top1

    greedy, top1 = arun(main, timeout=120)
    differ = [i for i, (g, t) in enumerate(zip(greedy, top1)) if g.tokens != t.tokens]
    assert not differ, f"{len(differ)} of 256 seeded top_k=1 rows differ from greedy: {differ[:8]}"


def test_a_sampled_filtered_rows_logprobs_are_those_of_its_distribution(tiny, arun):
    """temperature 0.7, top_k 5: each token's logprob and its 5 alternatives are those
    of log_softmax(top-5 of the model's logits / 0.7), the distribution it was drawn
    from, recomputed here from the model one step at a time."""
    temp, k = 0.7, 5

    async def main():
        eng = make(tiny)
        r = eng.submit("abc", chat=False, max_tokens=8, temperature=temp, top_k=k,
                       logprobs=k, seed=3)
        await r
        await eng.aclose()
        return r

    row = arun(main)
    model, _ = tiny
    ids = list(row.prompt_ids)
    assert len(row.logprobs) == len(row.tokens) > 0
    for tok, lp in zip(row.tokens, row.logprobs):
        logits = model(mx.array([ids]))[0, -1:].astype(mx.float32)
        filtered = apply_top_k(logits - mx.logsumexp(logits, axis=-1, keepdims=True), k)
        z = np.array(filtered[0] / temp, np.float64)
        fin = np.isfinite(z)
        ref = z - z[fin].max() - math.log(np.exp(z[fin] - z[fin].max()).sum())
        want = np.argsort(-ref, kind="stable")[:k]
        assert lp["token"] == tok and fin[tok]
        assert lp["logprob"] == pytest.approx(ref[tok], abs=1e-4)
        assert [t for t, _ in lp["top"]] == want.tolist()
        np.testing.assert_allclose([x for _, x in lp["top"]], ref[want], atol=1e-4)
        ids.append(tok)
