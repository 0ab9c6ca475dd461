"""Sliding windows of a decode batch (worker/windows.py): the lean cache's host-side
bookkeeping leaves it exactly where mlx-lm's BatchRotatingKVCache would be, op for
op, and unpadded rows decode past the window as they do alone."""

import asyncio
import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache

from mlxnb.core.worker import windows
from mlxnb.core.worker.caches import LeanBatchKVCache, aligned_views
from mlxnb.core.worker.windows import AlignedWindow, LeanBatchRotatingKVCache

from test_cache_kinds import engine

W, H, D = 8, 1, 4


def _kv(first: int, n: int, rows: int):
    """Keys whose every value is the position written (first .. first+n-1)."""
    pos = (first + mx.arange(n)).astype(mx.float32)[None, None, :, None]
    k = mx.broadcast_to(pos, (rows, H, n, D))
    return k, -k


def _state(c) -> list:
    keys = None if c.keys is None else c.keys_and_values()[0]
    return [None if keys is None else keys.tolist(), c.offset.tolist(),
            c.left_padding.tolist(), c._idx, c._offset, c.rotated]


def _same(lean, ref, what):
    assert _state(lean) == _state(ref), what
    for n in (1, 3):
        a, b = lean.make_mask(n, window_size=W), ref.make_mask(n, window_size=W)
        assert mx.array_equal(a, b).item(), (what, n)


@pytest.mark.parametrize("seed", range(12))
def test_the_lean_window_is_mlx_lms_op_for_op(seed):
    """Random runs of prefill chunks, one-token writes (the lean path), multi-token
    writes, filters and joins, each op on both caches: the same keys in view, row
    positions, padding, indices and masks after every one."""
    rnd = random.Random(seed)
    rows = rnd.choice([1, 2, 3])
    pads = [rnd.choice([0, 0, 2]) for _ in range(rows)]
    lean, ref = LeanBatchRotatingKVCache(W, pads), BatchRotatingKVCache(W, pads)
    pos = 0
    for n in (rnd.randint(1, 12),):  # the prompt
        for c in (lean, ref):
            c.update_and_fetch(*_kv(pos, n, rows))
        pos += n
    _same(lean, ref, "prefill")
    for step in range(40):
        op = rnd.random()
        if op < 0.7:  # a decode step
            lean.write_one(*_kv(pos, 1, rows))
            ref.update_and_fetch(*_kv(pos, 1, rows))
            pos += 1
        elif op < 0.8:  # a verification's multi-token write
            n = rnd.randint(2, 4)
            for c in (lean, ref):
                c.update_and_fetch(*_kv(pos, n, rows))
            pos += n
        elif op < 0.9 and rows > 1:  # a row leaves
            keep = mx.array(sorted(rnd.sample(range(rows), rows - 1)))
            for c in (lean, ref):
                c.filter(keep)
            rows -= 1
        else:  # a row joins, prefilled to the same length in one chunk
            other = (LeanBatchRotatingKVCache(W, [0]), BatchRotatingKVCache(W, [0]))
            for o in other:
                o.update_and_fetch(*_kv(pos - min(pos, 5), min(pos, 5), 1))
            lean.extend(other[0])
            ref.extend(other[1])
            rows += 1
        _same(lean, ref, (seed, step, op))


def test_a_merged_window_becomes_lean_with_its_arrays():
    from mlx_lm.models.cache import RotatingKVCache

    from mlxnb.core.worker.caches import merge_lean

    one, two = RotatingKVCache(W), RotatingKVCache(W)
    one.update_and_fetch(*_kv(0, 5, 1))
    two.update_and_fetch(*_kv(0, 3, 1))
    c = merge_lean([[one, two]])[0]
    ref = BatchRotatingKVCache.merge([one, two])
    assert type(c) is LeanBatchRotatingKVCache
    c.write_one(*_kv(5, 1, 2))
    ref.update_and_fetch(*_kv(5, 1, 2))
    _same(c, ref, "merged")


def test_aligned_views_give_windows_the_kv_layers_position():
    kv, win = LeanBatchKVCache([0, 0]), LeanBatchRotatingKVCache(W, [0, 0])
    for c in (kv, win):
        c.update_and_fetch(*_kv(0, 5, 2))
    views = aligned_views([kv, win], windows=True)
    assert isinstance(views[1], AlignedWindow) and views[1].offset == 5
    views[1].update_and_fetch(*_kv(5, 1, 2))
    assert views[1].offset == 6 and win.offset.tolist() == [6, 6]
    # a prefill group's windows (windows=False), or a model with windows only: as is
    assert aligned_views([kv, win])[1] is win
    assert aligned_views([win], windows=True)[0] is win


def test_unpadded_rows_decode_past_the_window_as_they_do_alone(arun, monkeypatch):
    """Rows of one prompt length decode together well past the window (8) through
    AlignedWindows, and each row's tokens are its tokens alone (whose decode takes
    them too, and which test_cache_kinds checks against mlx-lm's own generation)."""
    lean_writes = []
    real = windows.LeanBatchRotatingKVCache.write_one

    def spy(self, keys, values):
        lean_writes.append(keys.shape[0])
        return real(self, keys, values)

    monkeypatch.setattr(windows.LeanBatchRotatingKVCache, "write_one", spy)
    prompts = ["abcdef", "ghijkl", "mnopqr", "stuvwx"]  # 6 bytes each

    async def main():
        eng = engine("gemma3_text")
        alone = [(await eng.submit(p, max_tokens=24, chat=False)).tokens for p in prompts]
        lean_writes.clear()
        batched = [r.tokens for r in await eng.generate(prompts, max_tokens=24, chat=False)]
        await eng.aclose()
        return alone, batched

    alone, batched = arun(main)
    assert batched == alone
    assert len(set(map(tuple, alone))) > 1
    # two windows (of three layers), a write per decode step with all four rows
    assert lean_writes.count(4) == 2 * 24, lean_writes


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("prompts, one_wide", [
    (["ab", "a"], False),  # all but the last token: 1 and 0, a group one token wide
    (["abcdefghijklmnopq", "xyz", "hello"], True),  # past the window (8), 1-wide chunks
])
def test_a_padded_group_prefilled_one_token_at_a_time_is_mlx_lms_generation(
        arun, monkeypatch, kv_bits, prompts, one_wide):
    """mlx-lm's rotating cache takes a one-token update as a decode step, which it
    refuses while a right-padded group's lengths are set: such a chunk is prefill."""
    from mlxnb.core.worker import prefill
    from test_cache_kinds import mlx_lm_tokens

    if one_wide:  # every chunk one token wide, as a small step budget makes them
        monkeypatch.setattr(prefill, "pow2_floor", lambda n: 1)

    async def main():
        eng = engine("gemma3_text", kv_bits=kv_bits, kv_group_size=32, prefix_cache=None)
        rows = eng.generate(prompts, max_tokens=6, chat=False)
        res = await rows
        await eng.aclose()
        return [(r.prompt_ids, x) for r, x in zip(rows.rows, res)]

    for ids, res in arun(main):
        assert res.finish_reason == "length", res.error
        assert res.tokens == mlx_lm_tokens("gemma3_text", list(ids), 6, kv_bits=kv_bits,
                                           kv_group_size=32)
