"""A decode batch's sliding windows without a mask: `AlignedWindow` (caches.py) says
that rows holding the same number of tokens have only valid slots in their window,
however they got there (decoded in place, prefilled in chunks, joined by extend or
merged from single rows), so a one-token step needs no mask. Checked here on
mlx-lm's own BatchRotatingKVCache, slot by slot, and end to end by greedy parity."""

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from mlxnb.core.worker import caches as caches_mod
from mlxnb.core.worker.caches import AlignedWindow

from test_cache_kinds import build, engine

W, H, D = 8, 1, 4


def _kv(first: int, n: int, rows: int = 1):
    """Keys whose every value is the token's position (first .. first+n-1)."""
    pos = (first + mx.arange(n)).astype(mx.float32)[None, None, :, None]
    k = mx.broadcast_to(pos, (rows, H, n, D))
    return k, -k


def _fill(c, total: int, chunks, decode_from=None):
    """Write positions 0..total-1: prefill chunks of the given sizes, then one token
    a step from `decode_from` on."""
    pos = 0
    for n in chunks:
        c.update_and_fetch(*_kv(pos, n, c.offset.shape[0]))
        pos += n
    while pos < total:
        c.update_and_fetch(*_kv(pos, 1, c.offset.shape[0]))
        pos += 1
    return c


def _check_steps(c, total: int, steps: int):
    """Each one-token step: the batch's own mask is all True (None is exact), and
    every slot attended holds one of the row's latest min(T, W) positions, each once."""
    rows = c.offset.shape[0]
    for t in range(total, total + steps):
        mask = c.make_mask(1, window_size=W)
        assert mask is None or mx.all(mask).item(), (t, mask)
        k, _ = c.update_and_fetch(*_kv(t, 1, rows))
        n = min(t + 1, W)
        want = list(range(t + 1 - n, t + 1))
        for b in range(rows):
            got = sorted(int(x) for x in k[b, 0, :, 0].tolist())
            assert got == want, (t, b, got, want)


@pytest.mark.parametrize("total", [1, 3, 7, 8, 9, 12, 16, 17, 23])
@pytest.mark.parametrize("chunks", [(), (1,), (3,), (5, 4), (16,)])
def test_rows_with_equal_tokens_joined_by_extend_have_only_valid_slots(total, chunks):
    kept = []
    for n in chunks:  # the chunks that fit in `total`, in order
        if sum(kept) + n <= total:
            kept.append(n)
    chunks = tuple(kept) or (1,)
    # the running batch: prefilled in one chunk, then decoded in place
    running = _fill(BatchRotatingKVCache(W, [0, 0]), total, (min(total, 2),))
    # the joining group: prefilled in the given chunks up to the same count
    rest = total - sum(chunks)
    joining = _fill(BatchRotatingKVCache(W, [0]), total, chunks + ((rest,) if rest else ()))
    running.extend(joining)
    _check_steps(running, total, 2 * W)


@pytest.mark.parametrize("total", [1, 5, 8, 9, 20])
def test_rows_with_equal_tokens_merged_from_single_rows_have_only_valid_slots(total):
    one = RotatingKVCache(W)
    for p in range(total):  # decoded one token at a time
        one.update_and_fetch(*_kv(p, 1))
    two = RotatingKVCache(W)
    two.update_and_fetch(*_kv(0, total))  # one prompt chunk
    merged = BatchRotatingKVCache.merge([one, two])
    _check_steps(merged, total, 2 * W)


def test_aligned_window_mask_rules():
    c = _fill(BatchRotatingKVCache(W, [0, 0]), 5, (5,))
    view = AlignedWindow(c)
    assert view.max_size == W and view.offset.tolist() == [5, 5]  # the batch's own
    assert view.make_mask(1, window_size=W) is None
    assert view.make_mask(1) is None
    # a narrower window than the cache holds, or several tokens: the batch's own mask
    assert view.make_mask(1, window_size=4) is not None
    assert view.make_mask(3, window_size=W) is not None


def test_a_row_that_joined_padded_keeps_its_mask_until_its_window_is_rewritten():
    """Row 1 joined 5 tokens behind row 0, and row 0 left: the KV layers show the
    row alone and unpadded, but its window still holds padding slots until W more
    tokens have rewritten them: the batch's mask until then, none after."""
    from mlxnb.core.worker.caches import mark_windows

    running = _fill(BatchRotatingKVCache(W, [0]), 12, (4,))
    joining = _fill(BatchRotatingKVCache(W, [0]), 7, (7,))
    running.extend(joining)
    mark_windows([running])
    running.filter(mx.array([1]))
    view = AlignedWindow(running)
    masked = 0
    for t in range(7, 7 + 2 * W):
        mask = view.make_mask(1, window_size=W)
        if mask is None:
            assert running.make_mask(1, window_size=W).all().item(), t
        else:
            masked += 1
        k, _ = running.update_and_fetch(*_kv(t, 1))
        keep = (mx.ones(k.shape[2], mx.bool_) if mask is None else mask).reshape(-1)
        valid = sorted(int(x) for x, m in zip(k[0, 0, :, 0].tolist(), keep.tolist()) if m)
        assert valid == list(range(t + 1 - min(t + 1, W), t + 1)), (t, valid)
    assert masked == W  # exactly the steps until the window was rewritten


def test_aligned_rows_decode_past_the_window_as_they_do_alone(arun, monkeypatch):
    """Rows of one prompt length decode together well past the window (8): the
    windows are AlignedWindows (no mask), and each row's tokens are its tokens alone."""
    seen = {"alone": 0, "batched": 0}  # one-token steps that took no mask
    phase = ["alone"]
    real = AlignedWindow.make_mask

    def spy(self, N, window_size=None, return_array=False, **kw):
        out = real(self, N, window_size=window_size, return_array=return_array)
        seen[phase[0]] += out is None
        return out

    monkeypatch.setattr(AlignedWindow, "make_mask", spy)
    prompts = ["abcdef", "ghijkl", "mnopqr", "stuvwx"]  # 6 bytes each

    async def main():
        eng = engine("gemma3_text")
        alone = [(await eng.submit(p, max_tokens=24, chat=False)).tokens for p in prompts]
        phase[0] = "batched"
        batched = [r.tokens for r in await eng.generate(prompts, max_tokens=24,
                                                         chat=False)]
        await eng.aclose()
        return alone, batched

    alone, batched = arun(main)
    assert batched == alone
    assert len(set(map(tuple, alone))) > 1
    # every decode step took the view: 24 per row alone (the prefill leaves a
    # prompt's last token to the first step), 24 for the batch
    assert seen == {"alone": 4 * 24, "batched": 24}, seen


def test_which_windows_become_aligned_views():
    """A decode batch's windows (`windows=True`) when a KV layer tells the rows
    unpadded; a prefill group's windows stay the batch cache (its rows may be
    right-padded); a model of windows only keeps the batch mask."""
    from mlxnb.core.worker.caches import LeanBatchKVCache, left_padded

    padded = LeanBatchKVCache([0, 2])
    padded.update_and_fetch(*_kv(0, 4, 2))
    assert left_padded([padded, BatchRotatingKVCache(W, [0, 2])])
    win = BatchRotatingKVCache(W, [0, 0])
    views = caches_mod.aligned_views([LeanBatchKVCache([0, 0]), win], windows=True)
    assert isinstance(views[1], AlignedWindow) and views[1].c is win
    assert caches_mod.aligned_views([LeanBatchKVCache([0, 0]), win])[1] is win
    assert caches_mod.aligned_views([win], windows=True)[0] is win
