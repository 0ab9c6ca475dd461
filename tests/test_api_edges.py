"""What users hand the Python API that a magic never would: numbers of other types,
callables that raise anything or hold what cannot be copied, overlapping closes.
Each case runs beside a bystander row, which must finish as if nothing happened."""

import asyncio
import threading
from fractions import Fraction

import numpy as np
import pytest

from mlxnb import Engine


def make(model, **kw):
    kw.setdefault("kv_budget", None)
    return Engine(model, **kw)


async def beside_a_bystander(eng, submit):
    """Submit `submit()` while a bystander decodes; both rows, ended."""
    by = eng.submit("a bystander row", chat=False, max_tokens=40)
    while by.state != "decode":
        await asyncio.sleep(0.001)
    row = submit()
    await asyncio.wait_for(asyncio.gather(by, row), 30)
    assert (by.finish_reason, by.ntok) == ("length", 40), by.error
    return row


@pytest.mark.parametrize("kw", [
    dict(temperature=np.float32(0.7), seed=np.int64(3)),
    dict(temperature=Fraction(1, 2), seed=1),
    dict(top_p=np.float32(0.9), temperature=0.5, seed=2),
    dict(min_p=Fraction(1, 10), temperature=0.5, seed=2),
    dict(repetition_penalty=np.float32(1.1)),
    dict(max_tokens=np.int64(5), top_k=np.int32(4), logprobs=np.int8(2)),
])
def test_numbers_of_other_types_are_taken_as_pythons(tiny, arun, kw):
    async def main():
        eng = make(tiny)
        kw.setdefault("max_tokens", 5)
        row = await beside_a_bystander(eng, lambda: eng.submit("x", chat=False, **kw))
        await eng.aclose()
        return row

    row = arun(main)
    assert row.finish_reason == "length" and row.ntok == 5, row.error
    for name in kw:
        v = getattr(row.params, name)
        assert type(v) in (int, float), (name, type(v))
        assert v == pytest.approx(float(kw[name])), name


class Processor:
    """A logits processor holding what cannot be copied (as one holding a second model
    would hold what should not be), counting its calls."""

    def __init__(self):
        self.lock, self.calls = threading.Lock(), 0

    def __call__(self, tokens, logits):
        with self.lock:
            self.calls += 1
        return logits


def test_a_row_whose_processor_cannot_be_copied_ends_and_reports(tiny, arun):
    proc = Processor()

    async def main():
        eng = make(tiny)
        row = await beside_a_bystander(eng, lambda: eng.submit(
            "x", chat=False, max_tokens=6, logits_processors=[proc]))
        res = row.result()
        await eng.aclose()
        return row, res

    row, res = arun(main)
    assert row.finish_reason == "length" and proc.calls >= 5
    assert "logits_processors" not in res.params and res.params["max_tokens"] == 6


# (a KeyboardInterrupt too: signals reach the main thread only, so one raised on the
# worker is the callback's own)
@pytest.mark.parametrize("exc", [asyncio.CancelledError, SystemExit, GeneratorExit,
                                 KeyboardInterrupt])
@pytest.mark.parametrize("where", ["stop", "processor"])
def test_a_callable_raising_anything_ends_its_row_only(tiny, arun, exc, where):
    def stop(text):
        if len(text) > 2:
            raise exc("from the user's callable")
        return False

    def processor(tokens, logits):
        raise exc("from the user's callable")

    async def main():
        eng = make(tiny)
        kw = dict(stop=[stop]) if where == "stop" else dict(logits_processors=[processor])
        row = await beside_a_bystander(eng, lambda: eng.submit(
            "x", chat=False, max_tokens=30, **kw))
        after = await asyncio.wait_for(eng.submit("after", chat=False, max_tokens=3), 30)
        await eng.aclose()
        return row, after

    row, after = arun(main)
    assert row.finish_reason == "error" and exc.__name__ in row.error
    assert after.finish_reason == "length"  # the engine still serves


@pytest.mark.parametrize("exc", [asyncio.CancelledError, SystemExit, GeneratorExit,
                                 KeyboardInterrupt])
def test_a_stop_callable_raising_anything_as_its_row_is_cancelled_ends_that_row_only(
        tiny, arun, exc):
    seen = []

    def stop(text):  # raises only when shown the same text again: as its row ends
        if seen and text == seen[-1]:
            raise exc("from the user's callable")
        seen.append(text)
        return False

    async def main():
        eng = make(tiny)

        async def cancelled_midway():
            row = eng.submit("x", chat=False, max_tokens=300, stop=[stop])
            while row.ntok < 3:
                await asyncio.sleep(0.001)
            row.cancel()
            return row

        task = asyncio.ensure_future(cancelled_midway())
        await beside_a_bystander(eng, lambda: task)
        after = await asyncio.wait_for(eng.submit("after", chat=False, max_tokens=3), 30)
        await eng.aclose()
        return task.result(), after

    row, after = arun(main)
    assert row.finish_reason == "cancelled" and 3 <= row.ntok < 300
    assert after.finish_reason == "length"  # the engine still serves


def test_a_close_during_an_aclose_lets_the_aclose_return_at_once(tiny, arun):
    async def main():
        eng = make(tiny)
        rows = [eng.submit(f"row {i}", chat=False, max_tokens=2000) for i in range(3)]
        while not all(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        closing = asyncio.ensure_future(eng.aclose())
        while eng._idle is None:  # until it waits for the scheduler to go idle
            await asyncio.sleep(0)
        eng.close()
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(closing, 8)  # (its own bound is 10 s)
        return rows, asyncio.get_running_loop().time() - t0

    rows, waited = arun(main)
    assert {r.finish_reason for r in rows} == {"cancelled"} and waited < 2


def test_overlapping_closes_both_return_promptly(tiny, arun):
    """A second aclose() while the first waits for the scheduler must not leave the
    first waiting out its 10 s bound."""
    async def main():
        eng = make(tiny)
        rows = [eng.submit(f"row {i}", chat=False, max_tokens=2000) for i in range(3)]
        while not all(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        await asyncio.wait_for(asyncio.gather(eng.aclose(), eng.aclose()), 5)
        await eng.aclose()  # and a later one returns at once
        return rows

    assert {r.finish_reason for r in arun(main)} == {"cancelled"}


@pytest.mark.parametrize("kw,name", [
    (dict(streak_s=float("inf")), "streak_s"), (dict(streak_s=-1), "streak_s"),
    (dict(streak_s=float("nan")), "streak_s"), (dict(max_batch=0), "max_batch"),
    (dict(kv_bits=3), "kv_bits"), (dict(load_timeout=0), "load_timeout"),
    (dict(fill_threads=0), "fill_threads"), (dict(speculate="fast"), "speculate"),
    (dict(prefix_cache=-1), "prefix_cache"), (dict(kv_budget=float("nan")), "size"),
])
def test_engine_options_are_refused_in_one_line_naming_the_option(tiny, kw, name):
    with pytest.raises(ValueError) as e:
        make(tiny, **kw)
    msg = str(e.value)
    assert name in msg and "\n" not in msg, msg


def test_a_row_too_long_to_run_records_its_parameters(tiny, arun):
    async def main():
        eng = make(tiny)
        eng.context_length = 64
        row = eng.submit("x" * 200, chat=False, max_tokens=8, stop="zz",
                         temperature=0.5, seed=7, logprobs=2)
        res = await asyncio.wait_for(row, 10)
        await eng.aclose()
        return res

    res = arun(main)
    assert res.finish_reason == "error" and "context of 64" in res.error
    p = res.params
    assert (p["stop"], p["temperature"], p["seed"], p["logprobs"]) == (("zz",), 0.5, 7, 2)


def test_an_engine_that_fails_after_its_model_is_set_up_lets_go_of_it(tiny, monkeypatch):
    """(In a notebook the traceback outlives the cell: whatever it references stays.)"""
    from mlxnb.core import engine as engine_module
    from mlxnb.core.worker.batch import BatchExecutor

    closed, close = [], BatchExecutor.close
    monkeypatch.setattr(BatchExecutor, "close",
                        lambda self, *a, **kw: (closed.append(self), close(self, *a, **kw)))

    def broken(ex, run):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(engine_module, "warm_up", broken)
    with pytest.raises(RuntimeError, match="warm-up failed") as e:
        make(tiny)
    assert len(closed) == 1
    tb, engines = e.value.__traceback__, []
    while tb is not None:
        engines += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, Engine)]
        tb = tb.tb_next
    assert engines and all(eng._exec is None for eng in engines)


def test_done_callbacks_run_on_the_loop_whichever_thread_adds_them(tiny, arun):
    async def main():
        eng = make(tiny)
        loop_thread = threading.get_ident()
        rows = [eng.submit(f"row {i}", chat=False, max_tokens=1 + i % 5) for i in range(12)]
        seen, ended = [], threading.Event()

        def add_all():  # while rows end, and after they have
            for r in rows:
                r.add_done_callback(lambda row: seen.append((row.id, threading.get_ident())))
            ended.wait(30)
            for r in rows:
                r.add_done_callback(lambda row: seen.append((row.id, threading.get_ident())))

        adder = threading.Thread(target=add_all)
        adder.start()
        await asyncio.gather(*rows)
        ended.set()
        while adder.is_alive():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # callbacks queued to the loop run
        await eng.aclose()
        return seen, loop_thread, rows

    seen, loop_thread, rows = arun(main)
    assert sorted(i for i, _ in seen) == sorted([r.id for r in rows] * 2)
    assert {t for _, t in seen} == {loop_thread}


def test_a_row_an_interrupt_left_unqueued_ends_when_stopped(tiny, arun, monkeypatch):
    """An interrupt between a submit's steps (the row made, not yet queued): stopping
    everything must still end it, or waiting for the engine would wait for ever."""
    async def main():
        eng = make(tiny)
        by = eng.submit("a bystander row", chat=False, max_tokens=400)
        real = eng._enqueue

        def interrupted(row, *a):
            raise KeyboardInterrupt

        monkeypatch.setattr(eng, "_enqueue", interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.submit("x", chat=False, max_tokens=5)
        monkeypatch.setattr(eng, "_enqueue", real)
        stuck = [r for r in eng.rows if r is not by]
        eng.cancel_all()
        await asyncio.wait_for(eng.wait(), 10)
        await eng.aclose()
        return by, stuck

    by, stuck = arun(main)
    assert by.finish_reason == "cancelled"
    assert len(stuck) == 1 and stuck[0].finish_reason == "cancelled"


def test_a_submit_after_the_engines_loop_closed_raises_and_leaves_no_coroutine(tiny):
    import gc
    import warnings

    async def made():
        return make(tiny)

    loop = asyncio.new_event_loop()
    eng = loop.run_until_complete(made())
    loop.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeError, match="event loop is closed; create a new Engine"):
            eng.submit("x", chat=False, max_tokens=2)
        gc.collect()
    assert not eng._live
    eng.close()


@pytest.mark.parametrize("where", ["done callback", "listener"])
@pytest.mark.parametrize("exc", [asyncio.CancelledError, SystemExit, GeneratorExit,
                                 RuntimeError])
def test_a_callback_or_listener_raising_anything_leaves_the_other_rows_running(
        tiny, arun, where, exc):
    async def main():
        eng = make(tiny)

        def bad(*_):
            raise exc("from a user callback")

        def submit():
            if where == "listener":
                eng.add_listener(lambda kind, obj: bad() if kind == "finish" else None)
                return eng.submit("x", chat=False, max_tokens=3)
            row = eng.submit("x", chat=False, max_tokens=3)
            row.add_done_callback(bad)
            return row

        row = await beside_a_bystander(eng, submit)
        after = await asyncio.wait_for(eng.submit("after", chat=False, max_tokens=3), 10)
        await eng.aclose()
        return row, after

    row, after = arun(main)
    assert (row.finish_reason, after.finish_reason) == ("length", "length")


def test_submits_are_refused_once_aclose_has_begun(tiny, arun):
    """Rows accepted while aclose() waits for the batch to go idle would be served,
    and a steady stream of them held the close to its 10 s bound."""
    async def main():
        eng = make(tiny)
        eng.context_length = None  # a row that runs until the close
        row = eng.submit("a", chat=False, max_tokens=100000)
        while row.state != "decode":
            await asyncio.sleep(0.001)
        closing = asyncio.ensure_future(eng.aclose())
        await asyncio.sleep(0)  # the close has begun
        with pytest.raises(RuntimeError, match="this Engine is closing; create a new one"):
            eng.submit("b", chat=False, max_tokens=3)
        await asyncio.wait_for(closing, 10)
        with pytest.raises(RuntimeError, match="this Engine is closed"):
            eng.submit("c", chat=False, max_tokens=3)
        return row

    assert arun(main).finish_reason == "cancelled"


def test_a_row_that_cannot_fit_ends_at_once_counting_its_prompt(tiny, arun):
    async def main():
        eng = make(tiny, kv_budget="64KB")
        ctx = eng.submit("y" * 300, chat=False, max_tokens=10 ** 9)
        budget = eng.submit("z" * 3000, chat=False, max_tokens=8)
        ids = eng.encode("y" * 300, chat=False), eng.encode("z" * 3000, chat=False)
        rows = await asyncio.gather(ctx, budget)
        await eng.aclose()
        return rows, ids

    rows, ids = arun(main)
    assert [r.finish_reason for r in rows] == ["error", "error"]
    assert "context" in rows[0].error and "kv_budget" in rows[1].error
    assert [r.prompt_tokens for r in rows] == [len(i) for i in ids]


def test_an_error_text_holding_a_lone_surrogate_is_escaped(tiny, arun):
    import json

    def bad(tokens, logits):
        raise ValueError("bad \ud800 value")

    async def main():
        eng = make(tiny)
        row = eng.submit("x", chat=False, max_tokens=3, logits_processors=[bad])
        await row
        await eng.aclose()
        return row

    row = arun(main)
    assert row.error == "logits processor failed: ValueError: bad \\ud800 value"
    json.dumps({"error": row.error}, ensure_ascii=False).encode("utf-8")  # as sent


@pytest.mark.parametrize("model", [None, 3, ("only one",), "pair".split()[0:0]])
def test_a_model_that_is_no_name_path_or_pair_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match=r"^model takes a name, a path or a \(model, "
                                         r"tokenizer\) pair; got"):
        Engine(model, warmup=False)


def test_a_loaded_model_alone_is_refused_saying_to_pass_its_tokenizer(tiny):
    with pytest.raises(ValueError, match=r"a loaded model alone has no tokenizer: pass "
                                         r"\(model, tokenizer\)"):
        Engine(tiny[0], warmup=False)


def test_mlx_lms_model_tokenizer_config_triple_is_taken(tiny, arun):
    async def main():
        eng = Engine((tiny[0], tiny[1], {"model_type": "llama"}), warmup=False,
                     draft_model=(tiny[0], tiny[1], {}))
        row = await eng.submit("x", chat=False, max_tokens=3, speculate="draft")
        await eng.aclose()
        return row

    assert arun(main).finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match=r"a tuple of 3"):
        Engine((tiny[0], tiny[1], "not a config"), warmup=False)


def test_a_path_object_loads_like_its_string(tmp_path):
    from mlxnb.models.tiny import save_tiny_model

    eng = Engine(save_tiny_model(tmp_path / "tiny"), warmup=False)
    try:
        assert eng.model_name.endswith("tiny")
    finally:
        eng.close()


@pytest.mark.parametrize("kw,name", [(dict(kv_bits=4.0), "kv_bits"),
                                     (dict(kv_bits=4, kv_group_size=64.0), "kv_group_size")])
def test_kv_sizes_given_as_floats_are_refused_before_loading(kw, name):
    with pytest.raises(ValueError, match=rf"^{name} must be one of .*, got .*\.0$"):
        Engine("never-loaded/model", warmup=False, **kw)
