"""Engine behaviour on the tiny random-weight model, one behaviour per test."""

import asyncio
import copy
import threading

import pytest

from mlxnb import Engine

PROMPTS = ["hello there", "abc", "a somewhat longer prompt, with commas", "xyz 123"]


def make(tiny, **kw):
    kw.setdefault("kv_budget", None)
    return Engine(tiny, **kw)


async def alone(eng, prompt, **kw):
    return await eng.submit(prompt, chat=False, **kw)


def test_rows_finish_with_reasons_and_stats(tiny, arun):
    async def main():
        eng = make(tiny)
        res = await eng.generate(PROMPTS, max_tokens=12, chat=False)
        await eng.aclose()
        return res

    res = arun(main)
    assert [r.finish_reason for r in res] in (["length"] * 4,) or all(
        r.finish_reason in ("stop", "length") for r in res)
    for r in res:
        assert 1 <= len(r.tokens) <= 12
        assert r.prompt_tokens > 0 and r.ttft_s > 0
        assert r.finish_reason != "length" or len(r.tokens) == 12


def test_mlx_runs_on_one_worker_thread_and_loop_stays_free(tiny, arun):
    model, tok = tiny
    threads = set()
    orig = type(model).__call__

    def spy(self, *a, **k):
        threads.add(threading.current_thread().name)
        return orig(self, *a, **k)

    async def main():
        eng = make(tiny)
        type(model).__call__ = spy
        try:
            ticks = 0
            run = eng.generate(PROMPTS * 4, max_tokens=40, chat=False)
            while not run.done:
                ticks += 1
                await asyncio.sleep(0)
            await eng.aclose()
            return ticks, len(eng.steps)
        finally:
            type(model).__call__ = orig

    ticks, steps = arun(main)
    assert len(threads) == 1 and next(iter(threads)).startswith("mlxnb-mlx")
    assert ticks >= steps  # the loop ran other work between every step


def test_greedy_parity_batched_vs_alone(tiny, arun):
    kw = dict(chat=False, max_tokens=24, logprobs=1)

    async def main():
        eng = make(tiny, prefix_cache=None)
        solo = [await eng.submit(p, **kw) for p in PROMPTS]
        batched = await eng.generate(PROMPTS, **kw)
        # and staggered: rows join a batch already decoding (padded, chunked)
        first = eng.submit(PROMPTS[0], **kw)
        await asyncio.sleep(0.01)
        later = [eng.submit(p, **kw) for p in PROMPTS[1:]]
        stag = await asyncio.gather(first, *later)
        await eng.aclose()
        return solo, batched, stag

    solo, batched, stag = arun(main)
    assert all(same_logprobs(a, b) for a, b in zip(solo, batched))
    assert all(same_logprobs(a, b) for a, b in zip(solo, stag))


def test_seeded_rows_same_alone_or_anywhere_in_a_batch(tiny, arun):
    # the tiny model is peaked (N(0,1) tied embeddings): a high temperature makes
    # sampling actually random
    kw = dict(max_tokens=20, temperature=5.0, top_k=50)

    async def main():
        eng = make(tiny)
        a = (await alone(eng, "hello there", seed=7, **kw)).tokens
        rows = [eng.submit(p, chat=False, seed=s, **kw) for p, s in
                [("abc", 1), ("xyz", 2), ("hello there", 7), ("q", 3)]]
        b = (await asyncio.gather(*rows))[2].tokens
        c = (await alone(eng, "hello there", seed=8, **kw)).tokens
        await eng.aclose()
        return a, b, c

    a, b, c = arun(main)
    assert a == b
    assert a != c


def test_unseeded_sampling_reports_its_seed(tiny, arun):
    async def main():
        eng = make(tiny)
        r = await alone(eng, "hello", max_tokens=8, temperature=0.8)
        again = await alone(eng, "hello", max_tokens=8, temperature=0.8, seed=r.seed)
        await eng.aclose()
        return r, again

    r, again = arun(main)
    assert r.seed is not None and r.tokens == again.tokens


def test_continuous_batching_rows_join_running_batch(tiny, arun):
    async def main():
        eng = make(tiny)
        # long enough that a loaded host's delay before b's submit cannot let a end
        # (a tick decodes on for up to its streak); a is cancelled once b is done
        a = eng.generate(PROMPTS[:2], max_tokens=2000, chat=False)
        while not any(r.state == "decode" for r in a):
            await asyncio.sleep(0.001)
        b = eng.generate(PROMPTS[2:], max_tokens=10, chat=False)
        await b
        a.cancel()
        await a
        await eng.aclose()
        return eng.steps, a, b

    steps, a, b = arun(main)
    sizes = [s.batch_size for s in steps]
    assert max(sizes) == 4  # the later rows joined the earlier ones
    assert all(r.t_done < a[0].t_done for r in b)  # and left before them


def test_chunked_prefill_interleaves_with_decode(tiny, arun):
    long_prompt = "x" * 100

    async def main():
        eng = make(tiny, prefill_chunk=16)
        a = eng.submit("abc", chat=False, max_tokens=80)
        while a.state != "decode":
            await asyncio.sleep(0.001)
        b = eng.submit(long_prompt, chat=False, max_tokens=5)
        await a
        await b
        await eng.aclose()
        return eng.steps

    steps = arun(main)
    mixed = [s for s in steps if s.prefill_tokens and s.batch_size]
    assert len(mixed) >= 6  # ~100 tokens in chunks of 16, each beside a decode step
    assert max(s.prefill_tokens for s in steps) <= 16


def test_stop_strings_across_token_boundaries_are_not_emitted(tiny, arun):
    async def main():
        eng = make(tiny)
        full = (await alone(eng, "hello there", max_tokens=30)).text
        stop = full[5:8]  # three byte-tokens: the match spans token boundaries
        cut = await alone(eng, "hello there", max_tokens=30, stop=[stop, "never-appears"])
        await eng.aclose()
        return full, stop, cut

    full, stop, cut = arun(main)
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]
    assert stop not in cut.text


def test_eos_ends_row_with_stop(tiny, arun):
    model, tok = tiny

    async def main():
        eng = make(tiny)
        base = await alone(eng, "abc", max_tokens=10)
        await eng.aclose()
        # an engine whose tokenizer takes the row's 4th generated token for eos
        eos = copy.copy(tok)
        eos.eos_token_ids = {base.tokens[3]}
        eng = make((model, eos))
        r = await alone(eng, "abc", max_tokens=10)
        await eng.aclose()
        return base, r

    base, r = arun(main)
    assert r.finish_reason == "stop"
    assert r.tokens == base.tokens[: base.tokens.index(base.tokens[3])]


def test_logprobs_top_k(tiny, arun):
    import math

    async def main():
        eng = make(tiny)
        r = await alone(eng, "abc", max_tokens=6, logprobs=3)
        plain = await alone(eng, "abc", max_tokens=6)
        await eng.aclose()
        return r, plain

    r, plain = arun(main)
    assert plain.logprobs is None
    assert len(r.logprobs) == 6
    for tok, lp in zip(r.tokens, r.logprobs):
        assert lp["token"] == tok and lp["logprob"] <= 0
        ids = [i for i, _ in lp["top"]]
        assert len(ids) == 3 and ids[0] == tok  # greedy: the chosen one is the top one
        assert math.isclose(lp["top"][0][1], lp["logprob"], abs_tol=1e-5)


def test_kv_budget_makes_rows_wait_fifo_and_is_never_exceeded(tiny, arun):
    async def main():
        probe = make(tiny)
        one = probe.scheduler.row_bytes(20, 40)
        await probe.aclose()
        budget = int(one * 2.5)
        eng = make(tiny, kv_budget=budget)
        run = eng.generate([f"row {i:02d} {'y' * 8}" for i in range(8)], max_tokens=40,
                           chat=False)
        await run
        await eng.aclose()
        return eng, run, budget

    eng, run, budget = arun(main)
    assert all(r.finish_reason in ("length", "stop") for r in run)
    assert max(s.kv_bytes for s in eng.steps) <= budget
    assert max(s.batch_size for s in eng.steps) < 8  # the budget held rows back
    admits = [r.t_admit for r in run]
    assert admits == sorted(admits)  # FIFO


def test_row_that_can_never_fit_ends_with_clear_error(tiny, arun):
    async def main():
        eng = make(tiny, kv_budget="64KB")
        r = eng.submit("abc", chat=False, max_tokens=3000)
        res = await r
        with pytest.raises(ValueError, match="kv_budget"):
            eng.prepare("abc", chat=False, max_tokens=3000)
        await eng.aclose()
        return res

    res = arun(main)
    assert res.finish_reason == "error" and "kv_budget" in res.error


def same_logprobs(a, b, tol=1e-3):
    """Greedy tokens of the tiny model barely depend on context; log-probabilities
    do, so they are what shows a wrong KV cache."""
    return a.tokens == b.tokens and all(
        abs(x["logprob"] - y["logprob"]) < tol for x, y in zip(a.logprobs, b.logprobs))


def test_prefix_reuse_reports_cached_tokens_and_keeps_outputs(tiny, arun):
    header = "You are a helpful assistant. Answer briefly. " * 2

    async def main():
        eng = make(tiny)
        cold = Engine(tiny, kv_budget=None, prefix_cache=None)
        a = await alone(eng, header + "first", max_tokens=10, logprobs=1)
        b = await alone(eng, header + "second", max_tokens=10, logprobs=1)
        # a prefix hit while other rows decode, then a second hit on the same entry
        busy = eng.generate(["x", "yy"], max_tokens=40, chat=False)
        c = await alone(eng, header + "second!", max_tokens=10, logprobs=1)
        await busy
        refs = [await alone(cold, header + p, max_tokens=10, logprobs=1)
                for p in ("second", "second!")]
        await eng.aclose()
        await cold.aclose()
        return a, b, c, refs

    a, b, c, (ref_b, ref_c) = arun(main)
    assert a.cached_tokens == 0
    assert b.cached_tokens >= len(header)  # byte tokens: one per char
    assert c.cached_tokens >= len(header) + len("second") - 1  # b's last token is not stored
    assert ref_b.cached_tokens == 0
    assert same_logprobs(b, ref_b) and same_logprobs(c, ref_c)


def test_prefix_hits_join_the_batch_together_and_keep_outputs(tiny, arun):
    header = "You are a helpful assistant. Answer briefly. " * 2
    prompts = [header + f"question {i}" + "?" * i for i in range(6)]  # unequal lengths

    async def main():
        eng = make(tiny)
        cold = Engine(tiny, kv_budget=None, prefix_cache=None)
        await alone(eng, prompts[0], max_tokens=2)  # the header's KV, stored
        s0 = len(eng.steps)
        res = await eng.generate(prompts, chat=False, max_tokens=8, logprobs=1)
        sizes = [s.batch_size for s in eng.steps[s0:]]
        refs = [await alone(cold, p, max_tokens=8, logprobs=1) for p in prompts]
        await eng.aclose()
        await cold.aclose()
        return res, refs, sizes

    res, refs, sizes = arun(main)
    assert all(r.cached_tokens >= len(header) for r in res)
    assert next(b for b in sizes if b) == len(prompts)  # every hit joined in one step
    assert all(same_logprobs(r, ref) for r, ref in zip(res, refs))


@pytest.mark.parametrize("stage", ["queued", "prefill", "decode"])
def test_cancel_at_every_stage(tiny, arun, stage):
    async def main():
        eng = make(tiny, max_batch=1, prefill_chunk=4)
        blocker = eng.submit("abc", chat=False, max_tokens=30)
        # (long: its cancel must come before it could end, however late this task runs)
        target = eng.submit("z" * 60, chat=False, max_tokens=2000)
        if stage == "queued":
            assert target.state == "queued"
        else:
            await blocker
            while target.state != stage:
                await asyncio.sleep(0)
        target.cancel()
        res = await target
        after = await alone(eng, "next", max_tokens=5)  # the engine keeps serving
        await eng.aclose()
        return res, after

    res, after = arun(main)
    assert res.finish_reason == "cancelled"
    assert after.finish_reason in ("length", "stop")


def test_cancel_run_and_all(tiny, arun):
    async def main():
        eng = make(tiny)
        r1 = eng.generate(PROMPTS, max_tokens=200, chat=False)
        r2 = eng.generate(PROMPTS, max_tokens=200, chat=False)
        await asyncio.sleep(0.02)
        r1.cancel()
        await r1
        eng.cancel_all()
        await r2
        await eng.aclose()
        return r1, r2

    r1, r2 = arun(main)
    assert {r.finish_reason for r in r1} == {"cancelled"}
    assert {r.finish_reason for r in r2} <= {"cancelled", "length"}


def test_failing_callbacks_end_only_their_row(tiny, arun):
    def boom_stop(text):
        raise RuntimeError("stop callback bug")

    def boom_proc(tokens, logits):
        raise RuntimeError("processor bug")

    async def main():
        eng = make(tiny)
        ok = eng.submit("abc", chat=False, max_tokens=10)
        bad1 = eng.submit("abd", chat=False, max_tokens=10, stop=[boom_stop])
        bad2 = eng.submit("abe", chat=False, max_tokens=10, logits_processors=[boom_proc])
        res = await asyncio.gather(ok, bad1, bad2)
        ref = await alone(eng, "abc", max_tokens=10)
        await eng.aclose()
        return res, ref

    (ok, bad1, bad2), ref = arun(main)
    assert ok.finish_reason == "length" and ok.tokens == ref.tokens
    assert bad1.finish_reason == "error" and "stop callback" in bad1.error
    assert bad2.finish_reason == "error" and "processor" in bad2.error


def test_forward_error_fails_step_rows_then_engine_serves(tiny, arun):
    model, _ = tiny
    orig = type(model).__call__
    state = {"armed": False}

    def flaky(self, inputs, *a, **k):
        if state["armed"] and inputs.shape[1] == 1:
            state["armed"] = False
            raise RuntimeError("injected forward failure")
        return orig(self, inputs, *a, **k)

    async def main():
        eng = make(tiny)
        type(model).__call__ = flaky
        try:
            # (long: the armed failure must come before the rows could end)
            run = eng.generate(PROMPTS[:2], max_tokens=2000, chat=False)
            while not all(r.state == "decode" for r in run):
                await asyncio.sleep(0)
            state["armed"] = True
            res = await run
            after = await alone(eng, "next", max_tokens=5)
        finally:
            type(model).__call__ = orig
        await eng.aclose()
        return res, after

    res, after = arun(main)
    assert all(r.finish_reason == "error" and "injected" in r.error for r in res)
    assert after.finish_reason in ("length", "stop")


def test_sliding_window_model_batches_like_alone(tiny_swa, arun):
    async def main():
        eng = make(tiny_swa)
        solo = [(await alone(eng, p, max_tokens=30)).tokens for p in PROMPTS]
        batched = [r.tokens for r in await eng.generate(PROMPTS, max_tokens=30, chat=False)]
        await eng.aclose()
        return solo, batched

    solo, batched = arun(main)
    assert batched == solo


def test_bad_parameters_raise_one_line_errors(tiny, arun):
    async def main():
        eng = make(tiny)
        errs = []
        for kw in [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                   dict(min_p=1.5), dict(seed=-1), dict(seed=2 ** 32), dict(logprobs=99),
                   dict(bogus=1)]:
            with pytest.raises(ValueError) as e:
                eng.submit("abc", chat=False, **kw)
            errs.append(str(e.value))
        for p in ["", "   ", "bad \ud800 surrogate"]:
            with pytest.raises(ValueError) as e:
                eng.submit(p, chat=False)
            errs.append(str(e.value))
        await eng.aclose()
        return errs

    for msg in arun(main):
        assert msg and "\n" not in msg


def test_sizes_read_and_refused():
    from mlxnb._text import parse_bytes

    assert parse_bytes("2GB") == 2 << 30 and parse_bytes("512 mb") == 512 << 20
    assert parse_bytes(1e9) == 10 ** 9
    assert parse_bytes(None) is parse_bytes("inf") is parse_bytes(float("inf")) is None
    for bad in (float("nan"), "nan", "1e999", "nanGB", "lots"):
        with pytest.raises(ValueError, match="as a size; write e.g. '2GB'"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="^prefix_cache must be positive, got -1$"):
        parse_bytes(-1, "prefix_cache")


def test_steps_record_real_kv_bytes(tiny, arun):
    async def main():
        eng = make(tiny)
        run = eng.generate(PROMPTS, max_tokens=20, chat=False)
        await run
        await eng.aclose()
        return eng.steps, run

    steps, run = arun(main)
    full = [s for s in steps if s.batch_size == 4]
    assert full and all(s.kv_bytes > 0 for s in full)
    s = full[-1]
    assert set(s.row_kv_bytes) == {r.id for r in run}
    assert sum(s.row_kv_bytes.values()) <= s.kv_bytes


def test_text_matches_tokens_streamed_or_not(tiny, arun):
    _, tok = tiny

    async def main():
        eng = make(tiny)
        row = eng.submit("hello there", chat=False, max_tokens=30)
        seen = []
        while not row.done:  # read while streaming: lazy decoding catches up
            seen.append(row.text)
            await asyncio.sleep(0)
        plain = await row
        stopped = await alone(eng, "hello there", max_tokens=30, stop=["never-there"])
        await eng.aclose()
        return plain, stopped, seen

    plain, stopped, seen = arun(main)
    assert plain.text == tok.decode(plain.tokens) == stopped.text
    assert all(plain.text.startswith(s) for s in seen)


def test_a_cancelled_row_keeps_every_character_it_decoded(tiny, arun):
    _, tok = tiny

    async def main():
        eng = make(tiny)
        # a long stop string holds a tail of the text back until it cannot start one
        row = eng.submit("hello there", chat=False, max_tokens=400, stop=["never-there-at-all"])
        while len(row.tokens) < 12 and not row.done:
            await asyncio.sleep(0)
        row.cancel()
        await row
        await eng.aclose()
        return row

    row = arun(main)
    assert row.finish_reason == "cancelled" and len(row.tokens) >= 12
    assert row.text == tok.decode(row.tokens)


def test_step_history_is_bounded_and_numbered_on(tiny, arun, monkeypatch):
    import mlxnb.core.reports as me

    monkeypatch.setattr(me, "_KEEP_STEPS", 32)

    async def main():
        eng = make(tiny)
        await eng.generate(PROMPTS, max_tokens=120, chat=False)
        await eng.aclose()
        return eng.steps

    steps = arun(main)
    assert 32 <= len(steps) <= 34
    nums = [s.step for s in steps]
    assert nums == list(range(nums[0], nums[0] + len(nums))) and nums[0] > 80
