"""Prefill policy: the auto step budget, chunk shapes that repeat, and decode buffers
whose lengths keep MLX's CUDA backend off its per-shape cuDNN decode path."""

import asyncio

import mlx.core as mx
import pytest

from mlxnb import Engine
from mlxnb.batch import BatchExecutor
from mlxnb.prefill import _AUTO_MAX, _AUTO_MIN, _STALL_S, pow2_floor
from mlxnb.kvbatch import LeanBatchKVCache


def test_pow2_floor():
    assert [pow2_floor(n) for n in (0, 1, 2, 3, 63, 64, 65, 1000.5)] == [
        1, 1, 2, 2, 32, 64, 64, 512]


def test_auto_budget_follows_the_measured_rate(tiny):
    model, tok = tiny
    auto = BatchExecutor(model, tok, prefill_chunk=None)
    assert auto._step_budget() == _AUTO_MIN  # nothing measured yet
    auto._prefill_rate = 100_000 / _STALL_S  # 100k tokens in one stall: clamped
    assert auto._step_budget() == _AUTO_MAX
    auto._prefill_rate = 3000 / _STALL_S
    assert auto._step_budget() == 2048  # a power of two, so chunk shapes repeat
    fixed = BatchExecutor(model, tok, prefill_chunk=300)
    fixed._prefill_rate = 1e9
    assert fixed._step_budget() == 300  # an explicit chunk is a hard bound


def test_joiner_chunks_are_bucketed_beside_a_running_row(tiny, arun):
    """While a row decodes, joiners prefill in widths that are multiples of 64 (a
    group's whole width in one forward, or power-of-two chunks of it), whatever their prompt lengths: backends that set up kernels per
    shape (cuDNN attention on CUDA) then reuse them from run to run. (A row continuing
    from a reused prefix prefills its exact remainder; the prefix store is off here.)"""
    widths = []

    async def main():
        eng = Engine(tiny, kv_budget=None, prefill_chunk=None, prefix_cache=None)
        ex = eng._exec
        inner = ex.model

        class Spy:
            def __call__(self, x, cache=None):
                if x.shape[1] > 1:
                    widths.append(x.shape[1])
                return inner(x, cache=cache)

            def __getattr__(self, name):
                return getattr(inner, name)

        a = eng.submit("abc", chat=False, max_tokens=200)
        while a.state != "decode":
            await asyncio.sleep(0.001)
        ex.model = Spy()
        joiners = [eng.submit("j" * n, chat=False, max_tokens=3) for n in (5, 70, 130, 300)]
        for r in joiners:
            await r
        eng.cancel_all()
        await eng.aclose()
        return [r.finish_reason for r in joiners]

    reasons = arun(main)
    assert all(f in ("stop", "length") for f in reasons)
    assert widths and all(w % 64 == 0 for w in widths), widths


def test_auto_chunk_engine_matches_fixed_chunk_outputs(tiny, arun):
    prompts = ["q" * 700, "short", "m" * 90]

    async def main(chunk):
        eng = Engine(tiny, kv_budget=None, prefill_chunk=chunk)
        res = await eng.generate(prompts, max_tokens=6, chat=False)
        await eng.aclose()
        return [r.tokens for r in res]

    assert arun(main, None) == arun(main, 64)


def test_decode_buffers_never_a_multiple_of_256_long():
    c = LeanBatchKVCache([0, 0])
    k = mx.zeros((2, 1, 1, 8))
    lengths = set()
    for _ in range(800):
        c.update_and_fetch(k, k)
        lengths.add(c.keys.shape[2])
    assert lengths == {255, 510, 765, 1020}


@pytest.mark.parametrize("bad", [0, -1, 2.5, "512", True])
def test_bad_prefill_chunk_is_one_line_error(tiny, bad):
    with pytest.raises(ValueError, match="prefill_chunk must be a positive integer or None"):
        Engine(tiny, prefill_chunk=bad)
