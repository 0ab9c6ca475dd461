"""Row.trace, the step records the step inspector shows, and run.to_pandas()'s phase
columns, on the tiny model: each phase checked against what the engine did."""

import asyncio
import math

import pytest

from mlxnb import Engine
from mlxnb.core.rows import SPLIT_PARTS


def _phases(row, name):
    return [p for p in row.trace if p["phase"] == name]


def test_rows_queued_on_a_full_batch_say_so_and_phases_add_up(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, max_batch=2, warmup=False)
        run = eng.generate(["hello there", "abc", "third row", "fourth"], max_tokens=6,
                           chat=False)
        await run
        await eng.aclose()
        return eng, run

    eng, run = arun(main)
    for r in run.rows[2:]:  # two slots: rows 2 and 3 waited for the first two
        [q] = _phases(r, "queued")
        assert q["why"] == ["batch full"], r.trace
        assert q["s"] > 0 and math.isclose(q["s"], r.t_admit - r.t_submit)
    for r in run.rows:
        names = [p["phase"] for p in r.trace]
        assert names[0] == "queued" and names[-1] == "finish", names
        assert names.index("prefill") < names.index("first token") < names.index("decode")
        chunks = _phases(r, "prefill")
        assert sum(c["tokens"] for c in chunks) == r.prompt_tokens - r.cached_tokens
        [d] = _phases(r, "decode")
        assert d["tokens"] == r.ntok - 1 and d["tok_s"] == r.tok_s
        [f] = _phases(r, "finish")
        assert f["reason"] == r.finish_reason == "length"
        # the step records agree: the chunk's step prefilled this row, the row ended
        # in its finish step
        by_step = {s.step: s for s in eng.steps}
        for c in chunks:
            assert by_step[c["step"]].prefill_rows[r.id] == c["tokens"]
            assert math.isclose(c["t1"], by_step[c["step"]].t)
        assert r.id in by_step[f["step"]].ended
    df = run.to_pandas()
    for r, (_, rec) in zip(run.rows, df.iterrows()):
        assert math.isclose(rec["queue_s"] + rec["prefill_s"] + rec["decode_s"],
                            r.t_done - r.t_submit, rel_tol=1e-9)
        assert math.isclose(rec["prefill_s"], r.t_first - r.t_admit)


def test_a_row_queued_on_the_kv_budget_says_so(tiny, arun):
    async def main():
        probe = Engine(tiny, kv_budget=None, warmup=False)
        one = probe.kv_bytes_for(len("a long enough prompt") + 40)
        await probe.aclose()
        # room for one row's projected peak, not two
        eng = Engine(tiny, kv_budget=int(one * 1.5), max_batch=8, warmup=False)
        run = eng.generate(["a long enough prompt", "a long enough prompt"], max_tokens=40,
                           chat=False)
        await run
        await eng.aclose()
        return run

    run = arun(main)
    [q] = _phases(run.rows[1], "queued")
    assert q["why"] == ["KV budget"], run.rows[1].trace
    assert _phases(run.rows[0], "queued")[0]["why"] == []


def test_chunks_and_a_prefix_hit(tiny, arun):
    prompt = "the same long prompt, long enough for several chunks of prefill " * 2

    async def main():
        eng = Engine(tiny, kv_budget=None, prefill_chunk=16, warmup=False)
        # a row decoding alongside: the prompt is prefilled 16 tokens a step beside it
        busy = eng.submit("busy", max_tokens=2000, chat=False)
        while busy.ntok < 2:
            await asyncio.sleep(0.005)
        a = eng.submit(prompt, max_tokens=3, chat=False)
        await a
        busy.cancel()
        b = eng.submit(prompt + " and more", max_tokens=3, chat=False)
        await b
        await eng.aclose()
        return a, b

    a, b = arun(main)
    chunks = _phases(a, "prefill")
    assert len(chunks) >= 4 and all(c["tokens"] <= 16 for c in chunks), chunks
    assert [c["step"] for c in chunks] == sorted(c["step"] for c in chunks)
    assert all(c["s"] > 0 for c in chunks)
    assert b.cached_tokens > 0
    [hit] = _phases(b, "prefix hit")
    assert hit["tokens"] == b.cached_tokens
    assert sum(c["tokens"] for c in _phases(b, "prefill")) == b.prompt_tokens - b.cached_tokens


def test_every_step_says_where_its_time_went(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget="64MB", warmup=False)
        await eng.generate(["hello there", "abc"], max_tokens=8, chat=False)
        await eng.aclose()
        return eng

    eng = arun(main)
    assert eng.steps
    for s in eng.steps:
        assert len(s.split) == len(SPLIT_PARTS) and min(s.split) >= 0, s.split
        assert math.isclose(sum(s.split), s.dt_s, rel_tol=1e-6, abs_tol=1e-9), (s.split, s.dt_s)
        d = s.to_dict()
        assert set(d["split"]) == set(SPLIT_PARTS) and d["kv_budget"] == 64 << 20
        assert d["batch_ids"] == list(s.batch_ids)
    decode = [s for s in eng.steps if s.batch_size]
    assert decode and all(s.split[SPLIT_PARTS.index("device")] > 0 or s.split[0] > 0
                          for s in decode)
    assert sum(1 for s in eng.steps if s.ended) >= 1


def test_a_cancelled_queued_row_traces_queue_then_finish(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, max_batch=1, warmup=False)
        a = eng.submit("first", max_tokens=30, chat=False)
        b = eng.submit("second", max_tokens=30, chat=False)
        b.cancel()
        await a
        await b
        await eng.aclose()
        return b

    b = arun(main)
    assert [p["phase"] for p in b.trace] == ["queued", "finish"]
    assert b.trace[-1]["reason"] == "cancelled" and b.trace[0]["t1"] is None
