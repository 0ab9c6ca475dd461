"""Reliability of the engine: load under a tight KV budget, injected faults,
cancellation at every stage, closing with rows in flight, process exit, and model
loading that never runs code from the model directory.

Everything runs on the tiny random-weight model (`tiny` fixture). Each scenario ends
by checking that the affected rows carry a finish reason (and a message when it is
'error'), that rows next to them produced exactly their reference tokens, and that
the engine still serves a new submission.
"""

import asyncio
import gc
import json
import pickle
import random
import shutil
import textwrap
import threading
import time
from collections import Counter

import pytest

from mlxnb import Engine

REASONS = {"stop", "length", "cancelled", "error"}
BYSTANDER = "a bystander row that must not notice anything"


def make(tiny, **kw):
    kw.setdefault("kv_budget", None)
    return Engine(tiny, **kw)


async def alone(eng, prompt, **kw):
    return await eng.submit(prompt, chat=False, **kw)


async def assert_idle(eng):
    """Nothing left inside the executor or the scheduler once every row is done (a
    cancelled row is done at once; the executor lets go of it at its next tick)."""
    for _ in range(2000):
        st = eng.worker_state()
        if not st.busy:
            break
        await asyncio.sleep(0.001)
    assert not st.has_batch_cache and not st.batch and not st.decoding, st
    assert not st.prefilling and not st.ready and not st.in_flight and not st.leaving, st
    assert not eng.scheduler.active and not eng.scheduler.queue
    assert all(r.done and r.finish_reason in REASONS for r in eng.rows)
    for r in eng.rows:
        if r.finish_reason == "error":
            assert r.error and "\n" not in r.error, r.error


async def serves_next(eng):
    r = await asyncio.wait_for(alone(eng, "next one", max_tokens=4), 10)
    assert r.finish_reason in ("stop", "length") and r.tokens
    return r

def beside_a_bystander(tiny, arun, max_tokens, check_idle=True, **bad):
    """Run a faulty row ("abc" unless `prompt` is given) beside a bystander row;
    return (bystander's reference tokens, bystander result, faulty result)."""
    prompt = bad.pop("prompt", "abc")

    async def main():
        eng = make(tiny)
        ref = (await alone(eng, BYSTANDER, max_tokens=max_tokens)).tokens
        by = eng.submit(BYSTANDER, chat=False, max_tokens=max_tokens)
        row = eng.submit(prompt, chat=False, max_tokens=max_tokens, **bad)
        res = await asyncio.wait_for(asyncio.gather(by, row), 10)
        await serves_next(eng)
        if check_idle:
            await assert_idle(eng)
        await eng.aclose()
        return ref, res

    ref, (by, row) = arun(main)
    return ref, by, row



# -- load ---------------------------------------------------------------------------


@pytest.mark.integration
def test_load_1000_rows_in_bursts_under_a_tight_kv_budget(tiny, arun):
    """1,000 rows, mixed lengths, bursts from 5 coroutines, a budget of ~4 rows:
    all finish, reported KV never exceeds the budget, admission is FIFO, nothing
    deadlocks, and memory returns to where it started."""
    import mlx.core as mx

    n_coros, per_coro = 5, 200
    rng = random.Random(7)
    header = "Shared header for prefix reuse: "

    def prompt():
        body = "".join(rng.choice("abcdefghij klmnop,.") for _ in range(rng.randint(0, 40)))
        return (header if rng.random() < 0.3 else "") + body + "?"

    plans = [[(prompt(), rng.randint(1, 6), rng.random() < 0.03) for _ in range(per_coro)]
             for _ in range(n_coros)]

    async def main():
        gc.collect()
        mx.synchronize()
        mem0 = mx.get_active_memory()
        probe = make(tiny)
        budget = 4 * probe.scheduler.row_bytes(len(header) + 42, 6)
        await probe.aclose()
        eng = make(tiny, kv_budget=budget, max_batch=16, prefill_chunk=64)
        rows, cancelled = [], []

        async def client(plan):
            i = 0
            while i < len(plan):
                burst = rng.randint(1, 30)
                for p, mt, cancel in plan[i:i + burst]:
                    row = eng.submit(p, chat=False, max_tokens=mt,
                                     temperature=rng.choice([0.0, 0.0, 0.8]), seed=i)
                    rows.append(row)
                    if cancel:
                        cancelled.append(row)
                i += burst
                await asyncio.sleep(rng.random() * 0.005)
                for row in cancelled[-3:]:
                    row.cancel()

        t0 = time.perf_counter()
        await asyncio.gather(*(client(p) for p in plans))
        await asyncio.wait_for(eng.wait(), 60)  # a deadlock fails here, not in CI's limit
        wall = time.perf_counter() - t0
        await assert_idle(eng)
        await eng.aclose()
        gc.collect()
        mx.synchronize()
        return eng, rows, budget, mem0, mx.get_active_memory(), wall

    eng, rows, budget, mem0, mem1, wall = arun(main, timeout=120)
    assert len(rows) == n_coros * per_coro
    reasons = Counter(r.finish_reason for r in rows)
    assert set(reasons) <= {"stop", "length", "cancelled"}, reasons
    assert reasons["cancelled"] <= sum(p[2] for plan in plans for p in plan)
    for r in rows:
        if r.finish_reason == "length":
            assert len(r.tokens) == r.params.max_tokens
    peak = max(s.kv_bytes for s in eng.steps)
    assert peak <= budget, f"peak KV {peak} > budget {budget}"
    sizes = [s.batch_size for s in eng.steps]
    assert 2 <= max(sizes) < 16  # rows shared the batch, and the budget held others back
    admitted = [r for r in sorted(rows, key=lambda r: r.id) if r.t_admit is not None]
    assert len(admitted) >= len(rows) - reasons["cancelled"]
    stamps = [r.t_admit for r in admitted]
    assert stamps == sorted(stamps), "admission was not FIFO"
    assert eng.worker_state() is None and eng.model is None  # closing released them
    assert mem1 <= mem0 + (1 << 20), f"active memory {mem0} -> {mem1}"


def test_prefix_store_holds_no_more_memory_than_it_accounts(tiny, arun):
    """Once every row is done, the only KV left is the prefix store's, and that must be
    what `prefix_cache` budgets: ~3x more is held here, unaccounted."""
    import mlx.core as mx

    rng = random.Random(3)
    waves = [["".join(rng.choice("abcdefgh") for _ in range(rng.randint(10, 300)))
              for _ in range(8)] for _ in range(10)]

    async def main():
        gc.collect()
        mx.synchronize()
        mem0 = mx.get_active_memory()
        eng = make(tiny, max_batch=32)
        for prompts in waves:  # distinct prompts, prefilled as groups of 8
            await eng.generate(prompts, max_tokens=2, chat=False)
        gc.collect()
        mx.synchronize()
        held, accounted = mx.get_active_memory() - mem0, eng.worker_state().prefix_bytes
        await eng.aclose()
        return held, accounted

    held, accounted = arun(main)
    assert accounted > 0
    assert held <= 1.25 * accounted + (256 << 10), f"held {held} B, accounted {accounted} B"


@pytest.mark.parametrize("case", ["prefix_hits", "long_prompt_joins", "chunk_300",
                                  "chunk_auto"])
def test_reported_kv_never_exceeds_a_two_row_budget(tiny, arun, case):
    """Budget = exactly two of the largest rows. Merged batches, prefix-cache hits and
    chunk sizes that are not a multiple of 256 leave caches at unaligned sizes; the
    admission arithmetic must still bound what is really allocated."""
    header = "A shared header, long enough to be reused. "
    chunk = {"chunk_300": 300, "chunk_auto": None}.get(case, 64)
    if case == "prefix_hits":
        prompts = [header + s for s in ("one", "two", "three", "four", "five", "six")]
    elif case == "long_prompt_joins":
        prompts = ["short", "x" * 200, "mid " * 10, "y" * 230, "z", "w" * 120]
    else:
        prompts = ["q" * 700, "r" * 620, "s" * 40, "t" * 650]

    async def main():
        probe = make(tiny, prefill_chunk=chunk)
        budget = 2 * probe.scheduler.row_bytes(max(len(p) for p in prompts) + 1, 40)
        await probe.aclose()
        eng = make(tiny, kv_budget=budget, prefill_chunk=chunk)
        warm = await alone(eng, header + "warm", max_tokens=2)  # fills the prefix store
        run = eng.generate(prompts, max_tokens=40, chat=False)
        await asyncio.wait_for(run, 60)
        await eng.aclose()
        return eng, run, budget, warm

    eng, run, budget, warm = arun(main)
    assert all(r.finish_reason in ("stop", "length") for r in run)
    if case == "prefix_hits":
        assert any(r.cached_tokens for r in run)
    over = [(s.step, s.batch_size, s.kv_bytes) for s in eng.steps if s.kv_bytes > budget]
    assert not over, f"budget {budget} exceeded: {over[:3]}"


def test_sliding_window_reported_kv_within_budget(tiny_swa, arun):
    """Rotating caches hold window-1+chunk tokens while a chunk is prefilled; the
    admission arithmetic must count that, not just the window."""

    async def main():
        probe = make(tiny_swa, prefill_chunk=64)
        budget = probe.scheduler.row_bytes(301, 20)
        await probe.aclose()
        eng = make(tiny_swa, kv_budget=budget, prefill_chunk=64)
        r = await asyncio.wait_for(alone(eng, "y" * 300, max_tokens=20), 30)
        await eng.aclose()
        return eng, r, budget

    eng, r, budget = arun(main)
    assert r.finish_reason in ("stop", "length")
    peak = max(s.kv_bytes for s in eng.steps)
    assert peak <= budget, f"peak KV {peak} > budget {budget} (sliding window)"


def test_decoding_sliding_rows_are_charged_their_window(tiny_swa, arun):
    """Once decoding, a sliding-window row holds its window: a prefilled group is cut
    to it before it joins, so the decoding rows are not padded to a prefill chunk.
    A budget of two prefilling rows then runs more rows at once, reported KV stays
    within it as long rows join mid-decode, and every row decodes as it does alone."""
    prompts = [f"{i} " + "y" * 300 for i in range(6)]

    async def main():
        solo_eng = make(tiny_swa, prefill_chunk=64)
        solo = [(await alone(solo_eng, p, max_tokens=40)).tokens for p in prompts]
        costs = solo_eng.kv_bytes_for(343), solo_eng.kv_bytes_for(343, prefilling=False)
        await solo_eng.aclose()
        eng = make(tiny_swa, kv_budget=2 * costs[0], prefill_chunk=64)
        res = await eng.generate(prompts, max_tokens=40, chat=False)
        await eng.aclose()
        return solo, costs, eng, res

    solo, (pre, dec), eng, res = arun(main)
    assert 4 * dec < pre, (pre, dec)  # window + verification room, not + a chunk
    assert [r.tokens for r in res] == solo
    most = max(s.batch_size for s in eng.steps)
    assert most >= 3, most  # charged as prefilling for life, two would decode at once
    peak = max(s.kv_bytes for s in eng.steps)
    assert peak <= 2 * pre, f"peak KV {peak} > budget {2 * pre} (sliding window)"


def test_the_decode_window_slack_covers_the_widest_verification():
    """A decoding row's window is charged window + DECODE_WINDOW_SLACK positions; a
    verification holds window - 1 + (drafts + 1)."""
    from mlxnb._text import RANGES
    from mlxnb.core.worker.draft import MAX_K
    from mlxnb.core.worker.setup import DECODE_WINDOW_SLACK
    from mlxnb.core.worker.specpolicy import MAX_DRAFT

    widest = max(k for k in range(1000) if RANGES["num_draft"][0](k))
    assert max(widest, MAX_DRAFT, MAX_K) + 1 <= DECODE_WINDOW_SLACK


def test_a_joining_group_does_not_pad_decoding_windows_to_its_chunk(tiny_swa, arun,
                                                                    monkeypatch):
    """A join pads both sides to the longer one: a group fresh from a 128-token chunk
    would make every decoding row's window hold window - 1 + 128 positions until the
    next write trims it (a memory spike of chunk/window per join: 17x on Gemma-3)."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    from mlxnb.core.worker.setup import DECODE_WINDOW_SLACK

    held = []
    extend = BatchRotatingKVCache.extend

    def spy(self, other):
        extend(self, other)
        held.append((self.keys.shape[2], self.max_size))

    monkeypatch.setattr(BatchRotatingKVCache, "extend", spy)

    async def main():
        eng = make(tiny_swa, prefill_chunk=128)
        first = eng.submit("a short first row", chat=False, max_tokens=60)
        while not first.tokens:
            await asyncio.sleep(0.001)
        late = await alone(eng, "z" * 230, max_tokens=4)
        await first
        await eng.aclose()
        return late

    late = arun(main)
    assert late.finish_reason in ("stop", "length")
    assert held, "no group joined a decode batch"
    assert all(n <= w + DECODE_WINDOW_SLACK for n, w in held), held


# -- cancellation at every step ----------------------------------------------------------


STAGES = ("queued", "mid_prefill", "prefill_complete", "joined", "decoding",
          "last_in_flight", "done")


def test_cancel_at_every_stage_of_a_rows_life(tiny, arun):
    """One scenario per stage: cancel the target at the first step record that finds it
    there -- queued, mid-prefill (between chunks), prefill complete (merged into the
    batch in the very tick the cancel is applied), joined with no token read yet,
    decoding, last token in flight, ended. Stages the engine moves through within a
    single tick cannot be seen from the loop; then the cancel lands at the next one.
    Each time the target ends with a reason, its tokens are a prefix of its reference,
    the row beside it produces exactly its reference tokens, and no state leaks."""

    target_prompt = "t" * 30  # 4 chunks of 8 beside a decoding row

    async def main():
        # no prefix cache: a repeated prompt would otherwise skip its prefill entirely
        eng = make(tiny, max_batch=2, prefill_chunk=8, prefix_cache=None)
        ref = (await alone(eng, BYSTANDER, max_tokens=300)).tokens
        tref = (await alone(eng, target_prompt, max_tokens=40)).tokens
        landed, results = [], []
        for want in STAGES:
            by = eng.submit(BYSTANDER, chat=False, max_tokens=300)
            while by.state != "decode":  # so the target's prefill goes chunk by chunk
                await asyncio.sleep(0)
            blocker = eng.submit("blocker", chat=False, max_tokens=3) \
                if want == "queued" else None
            target = eng.submit(target_prompt, chat=False, max_tokens=40)

            def stage():
                if target.done:
                    return "done"
                if target.state == "prefill":
                    return ("prefill_complete" if target.prefill_done >= target.prompt_tokens - 1
                            else "mid_prefill" if target.prefill_done else "admitted")
                if target.state == "decode":
                    return ("joined" if not target.tokens else
                            "last_in_flight" if target.ntok == 39 else "decoding")
                return target.state

            def on(kind, obj, want=want):
                st = stage()
                if kind == "step" and not landed[-1:] == [(want, None)] and \
                        st in STAGES[STAGES.index(want):]:
                    landed.append((want, st))
                    target.cancel()

            if want == "queued":
                landed.append((want, stage()))
                target.cancel()
            else:
                eng.add_listener(on)
            tres = await asyncio.wait_for(target, 10)
            by.cancel()  # the bystander has shown what it had to; stop it early
            bres = await asyncio.wait_for(by, 10)
            if blocker is not None:
                await blocker
            eng.remove_listener(on)
            await assert_idle(eng)
            results.append((want, bres.tokens == ref[:len(bres.tokens)] and bres.tokens,
                            tres.finish_reason, tres.tokens == tref[:len(tres.tokens)]))
        await serves_next(eng)
        await eng.aclose()
        return landed, results

    landed, results = arun(main)
    assert all(ok for _, ok, _, _ in results), [r for r in results if not r[1]]  # bystander
    assert all(prefix_ok for *_, prefix_ok in results), results
    reasons = {want: reason for want, _, reason, _ in results}
    first = {}
    for want, st in landed:
        first.setdefault(want, st)
    seen = set(first.values())
    for must in ("queued", "mid_prefill", "prefill_complete", "decoding", "done"):
        assert must in seen, f"no cancel landed at stage {must!r}: {first}"
    for want, st in first.items():
        assert reasons[want] == ("length" if st == "done" else "cancelled"), (want, st)


def test_cancel_takes_effect_quickly_during_a_big_idle_prefill(tiny, arun):
    """Stop buttons must work while a burst of long prompts prefills. The forward is
    slowed to ~0.5 ms per token (a CPU running a real model does worse): 16 rows of
    300 tokens are ~2.4 s of prefill; a cancel should land within a few chunks."""
    model, _ = tiny
    orig = type(model).__call__

    def slow(self, inputs, *a, **k):
        time.sleep(0.0005 * inputs.size)
        return orig(self, inputs, *a, **k)

    async def main():
        # slow from the start: the engine's warm-up measures the rate it sizes
        # its first idle tick by
        type(model).__call__ = slow
        try:
            eng = make(tiny, prefill_chunk=64, max_batch=16, prefix_cache=None)
            rows = [eng.submit(f"{i:02d}" + "p" * 298, chat=False, max_tokens=4)
                    for i in range(16)]
            await asyncio.sleep(0.05)  # the first tick is under way
            t0 = time.perf_counter()
            rows[-1].cancel()
            await asyncio.wait_for(rows[-1], 30)
            latency = time.perf_counter() - t0
            eng.cancel_all()
            await asyncio.wait_for(asyncio.gather(*rows), 30)
        finally:
            type(model).__call__ = orig
        await eng.aclose()
        return latency

    latency = arun(main)
    # a tick is sized to 0.25 s; waiting out the whole prefill would take 2.4 s
    assert latency < 1.2, f"the cancel took {latency:.2f}s to take effect"


def test_cancel_from_another_thread(tiny, arun):
    """Subshell cells run on other threads: cancel() from there reaches the loop."""

    async def main():
        eng = make(tiny)
        rows = [eng.submit(p, chat=False, max_tokens=400) for p in ("one", "two", "three")]
        while not all(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        t = threading.Thread(target=eng.cancel, args=(rows[:2],))
        t.start()
        t.join()
        res = await asyncio.wait_for(asyncio.gather(*rows[:2]), 10)
        rows[2].cancel()
        await rows[2]
        await serves_next(eng)
        await assert_idle(eng)
        await eng.aclose()
        return res

    assert [r.finish_reason for r in arun(main)] == ["cancelled", "cancelled"]


def test_aclose_with_rows_in_flight_is_quick_and_final(tiny, arun):
    async def main():
        eng = make(tiny, max_batch=3, prefill_chunk=8)
        rows = [eng.submit(f"row {i} " + "p" * 40, chat=False, max_tokens=2000)
                for i in range(6)]
        while not any(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        states = Counter(r.state for r in rows)
        t0 = time.perf_counter()
        await eng.aclose()
        dt = time.perf_counter() - t0
        errors = []
        for call in (lambda: eng.submit("again", chat=False),
                     lambda: eng.generate(["again"], chat=False)):
            with pytest.raises(RuntimeError) as e:
                call()
            errors.append(str(e.value))
        await eng.aclose()  # twice is harmless
        return eng, rows, states, dt, errors

    eng, rows, states, dt, errors = arun(main)
    assert states["queued"] and states["decode"]  # some queued, some running
    assert dt < 2.0, f"aclose took {dt:.2f}s"
    assert [r.finish_reason for r in rows] == ["cancelled"] * 6
    assert all(len(r.tokens) < 2000 for r in rows)
    assert eng.closed and eng.worker_state() is None and eng.model is None
    for msg in errors:
        assert "closed" in msg and "\n" not in msg


def test_submit_racing_aclose_ends_or_is_refused(tiny, arun):
    async def main():
        eng = make(tiny)
        first = eng.submit("first", chat=False, max_tokens=500)
        await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(eng.aclose())
        await asyncio.sleep(0)
        late = []
        for _ in range(3):
            try:
                late.append(eng.submit("late", chat=False, max_tokens=500))
            except RuntimeError:
                pass
            await asyncio.sleep(0)
        await asyncio.wait_for(closing, 5)
        await asyncio.wait_for(asyncio.gather(first, *late), 5)
        return first, late

    first, late = arun(main)
    assert first.finish_reason == "cancelled"
    assert all(r.done and r.finish_reason in REASONS for r in late)


def test_sync_close_with_rows_in_flight(tiny, arun):
    async def main():
        eng = make(tiny)
        rows = [eng.submit(p, chat=False, max_tokens=1000) for p in ("a b", "c d")]
        while not all(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        eng.close()
        res = await asyncio.wait_for(asyncio.gather(*rows), 5)
        with pytest.raises(RuntimeError, match="closed"):
            eng.submit("x", chat=False)
        return res

    assert [r.finish_reason for r in arun(main)] == ["cancelled", "cancelled"]


# -- injected faults -------------------------------------------------------------------


def test_prefill_forward_raises_once(tiny, arun):
    """A forward that fails during one row's prefill chunk ends that row only."""
    model, _ = tiny
    orig = type(model).__call__
    armed = {"on": False}

    def flaky(self, inputs, *a, **k):
        if armed["on"] and inputs.shape[1] > 1:
            armed["on"] = False
            raise RuntimeError("injected prefill failure")
        return orig(self, inputs, *a, **k)

    async def main():
        eng = make(tiny, prefill_chunk=8)
        ref = (await alone(eng, BYSTANDER, max_tokens=30)).tokens
        by = eng.submit(BYSTANDER, chat=False, max_tokens=30)
        while by.state != "decode":
            await asyncio.sleep(0)
        type(model).__call__ = flaky
        try:
            armed["on"] = True
            victim = eng.submit("v" * 40, chat=False, max_tokens=10)
            res = await asyncio.wait_for(asyncio.gather(by, victim), 10)
            after = await serves_next(eng)
        finally:
            type(model).__call__ = orig
        await assert_idle(eng)
        await eng.aclose()
        return ref, res, after

    ref, (by, victim), after = arun(main)
    assert victim.finish_reason == "error" and "injected prefill failure" in victim.error
    assert by.finish_reason == "length" and by.tokens == ref


def test_join_failure_does_not_strand_rows(tiny, arun, monkeypatch):
    """If joining a prefilled row onto the running batch raises, the rows involved must
    end with 'error' -- not stay in 'prefill' forever, holding their KV reservation."""
    from mlx_lm.models import cache as cache_mod

    orig = cache_mod.BatchKVCache.extend
    armed = {"on": False}

    def flaky(self, other):
        if armed["on"]:
            armed["on"] = False
            raise MemoryError("injected join failure")
        return orig(self, other)

    monkeypatch.setattr(cache_mod.BatchKVCache, "extend", flaky)

    async def main():
        eng = make(tiny)
        first = eng.submit("already decoding", chat=False, max_tokens=200)
        while first.state != "decode":
            await asyncio.sleep(0)
        armed["on"] = True
        joiner = eng.submit("joins the batch", chat=False, max_tokens=5)
        res = await asyncio.wait_for(asyncio.gather(first, joiner), 10)  # hangs if lost
        await serves_next(eng)
        await assert_idle(eng)
        await eng.aclose()
        return res

    first, joiner = arun(main)
    assert joiner.finish_reason == "error" and "join failure" in joiner.error
    assert first.finish_reason in ("error", "length", "stop")


def test_logits_processor_raises_mid_generation(tiny, arun):
    calls = {"n": 0}

    def late_boom(history, logits):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("processor failed late")
        return logits

    ref, by, bad = beside_a_bystander(tiny, arun, 20, logits_processors=[late_boom])
    assert bad.finish_reason == "error" and "processor failed late" in bad.error
    assert 1 <= len(bad.tokens) <= 4
    assert by.tokens == ref


def _np_logits(logits):
    import numpy as np

    return np.array(logits)


BAD_PROCESSOR_RETURNS = {
    "none": lambda logits: None,
    "1-d": lambda logits: logits[0],
    "short_vocab": lambda logits: logits[:, :10],
    "two_rows": lambda logits: __import__("mlx.core").core.concatenate([logits, logits]),
    "numpy": _np_logits,
    "int_dtype": lambda logits: logits.astype(__import__("mlx.core").core.int32),
}


@pytest.mark.parametrize("kind", sorted(BAD_PROCESSOR_RETURNS))
def test_logits_processor_bad_return_value_ends_only_its_row(tiny, arun, kind):
    """A processor that returns something that is not [1, vocab] logits must end its
    own row with a one-line error (or be tolerated), never fail the whole batch."""
    ret = BAD_PROCESSOR_RETURNS[kind]

    ref, by, bad = beside_a_bystander(tiny, arun, 12, check_idle=False, prompt="abd",
                                      logits_processors=[lambda h, l: ret(l)])
    assert by.finish_reason == "length" and by.tokens == ref, by.error
    assert bad.finish_reason in ("error", "length", "stop")
    if bad.finish_reason == "error":
        assert "processor" in bad.error and "\n" not in bad.error, bad.error


def test_stop_callback_returning_unusable_value(tiny, arun):
    class NoBool:
        def __bool__(self):
            raise TypeError("truth value is ambiguous")

    ref, by, bad = beside_a_bystander(tiny, arun, 10, stop=[lambda text: NoBool()])
    assert bad.finish_reason == "error" and "stop callback" in bad.error
    assert by.tokens == ref


def test_failing_listeners_and_done_callbacks_do_not_stop_generation(tiny, arun):
    def boom(*a):
        raise RuntimeError("listener bug")

    async def main():
        eng = make(tiny)
        eng.add_listener(boom)
        row = eng.submit("abc", chat=False, max_tokens=8)
        row.add_done_callback(boom)
        res = await asyncio.wait_for(row, 10)
        await serves_next(eng)
        await eng.aclose()
        return res

    assert arun(main).finish_reason == "length"


def test_prompt_that_encodes_to_no_tokens_is_refused(tiny, arun):
    """Real tokenizers map some inputs to no ids at all (SmolLM2's encodes '\\x04'
    to [] without a chat template). Such a row must be refused or end with 'error';
    it must not sit in 'prefill' forever."""

    class DropsControlChars:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode(self, text, **kw):
            return [i for i in self._tok.encode(text, **kw) if i >= 32]

    async def main():
        eng = make(tiny, max_batch=1)
        eng.tokenizer = DropsControlChars(eng.tokenizer)
        try:
            row = eng.submit("\x04\x06", chat=False, max_tokens=5)
        except ValueError as e:
            outcome = ("raised", str(e))
        else:
            res = await asyncio.wait_for(row, 5)
            outcome = (res.finish_reason, res.error)
        await serves_next(eng)
        await eng.aclose()
        return outcome

    kind, msg = arun(main)
    assert kind in ("raised", "error") and msg and "\n" not in msg


# -- loading never runs code from the model directory --------------------------------

EVIL = textwrap.dedent("""
    open({marker!r}, "w").write(__name__)
    class EvilTokenizer: pass
    class EvilModel: pass
    class EvilConfig: pass
""")


class _PickleBomb:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _edit_json(path, drop=(), **updates):
    data = json.loads(path.read_text())
    data.update(updates)
    for k in drop:
        data.pop(k, None)
    path.write_text(json.dumps(data))


def _tok_auto_map(d, evil, unknown_class=True):
    (d / "tokenization_evil.py").write_text(evil)
    upd = {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer",
                                          "tokenization_evil.EvilTokenizer"]}}
    if unknown_class:
        upd["tokenizer_class"] = "EvilTokenizer"
    _edit_json(d / "tokenizer_config.json", **upd)


def _config_auto_map(d, evil):
    (d / "modeling_evil.py").write_text(evil)
    _edit_json(d / "config.json", auto_map={"AutoConfig": "modeling_evil.EvilConfig",
                                            "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    _edit_json(d / "tokenizer_config.json", drop=("tokenizer_class",))


def _model_file(d, evil):
    (d / "modeling_evil.py").write_text(evil)
    _edit_json(d / "config.json", model_file="modeling_evil.py")


def _pickles(d, marker, keep_safetensors=True):
    for name in ("pytorch_model.bin", "model.bin", "training_args.bin"):
        (d / name).write_bytes(pickle.dumps({"w": _PickleBomb(marker)}))
    if not keep_safetensors:
        (d / "model.safetensors").unlink()


SAFETY_CASES = {
    # name: (how to poison the directory, may it still load?)
    "tokenizer_auto_map_unknown_class": (lambda d, e, m: _tok_auto_map(d, e), False),
    "tokenizer_auto_map_known_class": (lambda d, e, m: _tok_auto_map(d, e, False), True),
    "config_auto_map": (lambda d, e, m: _config_auto_map(d, e), True),
    "config_model_file": (lambda d, e, m: _model_file(d, e), False),
    "pickle_bins_beside_safetensors": (lambda d, e, m: _pickles(d, m), True),
    "pickle_bins_only": (lambda d, e, m: _pickles(d, m, False), False),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from mlxnb.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("case", sorted(SAFETY_CASES))
def test_loading_never_executes_code_from_the_model_dir(tiny_dir, tmp_path, monkeypatch,
                                                         case):
    """A poisoned model directory is loaded without running its code, or refused with
    a ModelLoadError. Nothing may *ask* whether to run it either: in a notebook,
    transformers' "Do you wish to run the custom code? [y/N]" goes to the user, so we
    answer 'y' here and check that nothing ran all the same."""
    import builtins

    import mlxnb

    poison, may_load = SAFETY_CASES[case]
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    marker = tmp_path / "EXECUTED"
    poison(d, EVIL.format(marker=str(marker)), str(marker))
    prompts = []
    monkeypatch.setattr(builtins, "input", lambda *a: prompts.append(a) or "y")
    monkeypatch.syspath_prepend(str(d))  # even with the dir importable, nothing runs
    try:
        model, tok = mlxnb.load_model(str(d))
        outcome = "loaded"
    except mlxnb.ModelLoadError as e:
        outcome = str(e)
    assert not marker.exists(), f"code from the model directory ran ({case})"
    assert not prompts, f"load_model asked whether to run the model's code ({case})"
    if not may_load:
        assert outcome != "loaded"
    with pytest.raises(mlxnb.ModelLoadError, match="trust_remote_code"):
        mlxnb.load_model(str(d), trust_remote_code=True)
    assert not marker.exists()


def test_chat_template_cannot_escape_its_sandbox(tiny_dir, tmp_path, arun):
    """The chat template is code of a kind too (Jinja): a template that reaches for os
    must fail to render, not run a command."""
    import mlxnb

    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    marker = tmp_path / "EXECUTED"
    evil = ("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
            "{{ self.__init__.__globals__.__builtins__.open('" + str(marker) + "', 'w') }}")
    _edit_json(d / "tokenizer_config.json", chat_template=evil)
    pair = mlxnb.load_model(str(d))

    async def main():
        eng = Engine(pair, kv_budget=None)
        try:
            eng.submit("hello", max_tokens=3)
            outcome = "submitted"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        await serves_next(eng)  # chat=False still works
        await eng.aclose()
        return outcome

    outcome = arun(main)
    assert not marker.exists()
    assert outcome != "submitted"
