"""Decode streaks: the worker runs decode steps back to back without the event loop,
but new rows, cancels and a joined row's first token end a streak at once."""

import asyncio
import time

from mlxnb import Engine


def test_a_long_streak_does_not_delay_joiners_or_cancels(tiny, arun):
    async def main():
        # streaks of up to 30 s: only an interrupt ends one
        eng = Engine(tiny, kv_budget=None, warmup=False, streak_s=30.0)
        long = eng.submit("abc", chat=False, max_tokens=4000)
        while not long.tokens and not long.done:
            await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        joiner = eng.submit("hello there", chat=False, max_tokens=3)
        while not joiner.tokens:  # submitted mid-streak; first token reported alone
            await asyncio.sleep(0.001)
        ttft = time.perf_counter() - t0
        await joiner
        t1 = time.perf_counter()
        eng.cancel([long])
        await long
        cancel_s = time.perf_counter() - t1
        await eng.aclose()
        return ttft, cancel_s, long.finish_reason, joiner.finish_reason

    ttft, cancel_s, long_reason, joiner_reason = arun(main)
    assert (long_reason, joiner_reason) == ("cancelled", "length")
    assert ttft < 1 and cancel_s < 1, (ttft, cancel_s)
