"""Prefill policy: the auto step budget, chunk shapes that repeat, and decode buffers
whose lengths keep MLX's CUDA backend off its per-shape cuDNN decode path."""

import asyncio

import mlx.core as mx
import pytest

from mlxnb import Engine
from mlxnb.core.worker.batch import BatchExecutor
from mlxnb.core.worker.prefill_policy import AUTO_MAX, AUTO_MIN, STALL_S, PrefillPolicy, pow2_floor
from mlxnb.core.worker.caches import LeanBatchKVCache


def test_pow2_floor():
    assert [pow2_floor(n) for n in (0, 1, 2, 3, 63, 64, 65, 1000.5)] == [
        1, 1, 2, 2, 32, 64, 64, 512]


def test_auto_budget_follows_the_measured_rate():
    auto = PrefillPolicy(None)
    assert auto.step_budget() == AUTO_MIN  # nothing measured yet
    auto.rate = 100_000 / STALL_S  # 100k tokens in one stall: clamped
    assert auto.step_budget() == AUTO_MAX
    auto.rate = 3000 / STALL_S
    assert auto.step_budget() == 2048  # a power of two, so chunk shapes repeat
    # hysteresis: a rate that wobbles down keeps the budget (and the chunk shapes)
    # until the stall would pass twice the target
    for rate, budget in ((1500, 2048), (1100, 2048), (900, 512), (1100, 1024)):
        auto.rate = rate / STALL_S
        assert auto.step_budget() == budget, rate
        assert auto.current == budget  # the read changes nothing
    fixed = PrefillPolicy(300)
    fixed.rate = 1e9
    assert fixed.step_budget() == 300  # an explicit chunk is a hard bound


def test_policy_plans_and_observations():
    p = PrefillPolicy(None, prefill_rate=4000.0)
    # idle: about IDLE_TICK_S of the rate, groups may take everything waiting
    assert p.plan(decoding=False) == (1000, 8192)
    # beside decode: the step budget; groups sized from what waits, not this tick
    assert p.plan(decoding=True) == (AUTO_MIN, AUTO_MAX)
    assert PrefillPolicy(300).plan(decoding=True) == (300, None)
    p.observe_decode(0.010)
    assert p.step_s == 0.002  # a moving average
    # beside decode, the decode step launched before the prefill is not its cost
    p.observe_prefill(1000, 0.102, decoding=True, cold=False)
    assert p.rate_last == 10_000 and p.rate == 10_000
    # a slower warm tick lowers the estimate slowly, a cold one never
    p.observe_prefill(1000, 1.0, decoding=False, cold=True)
    assert p.rate == 10_000
    p.observe_prefill(1000, 1.0, decoding=False, cold=False)
    assert p.rate == 9_000 and p.rate_last == 1000
    assert p.plan(decoding=False)[0] == 512  # idle sizes by the latest rate
    p.reset(50.0)
    assert (p.rate, p.rate_last, p.step_s, p.current) == (50.0, 0.0, 0.0, AUTO_MIN)


def test_a_cold_tick_raises_the_rate_but_never_lowers_it(tiny):
    """A tick with a new shape under-reports the prefill rate (one-off setup), so it
    counts as a lower bound: a fresh engine, whose shapes are mostly new, must not sit
    at AUTO_MIN (on CUDA its joiners then waited many ticks each)."""
    from mlxnb.core.messages import Admit
    from mlxnb.core.rows import SamplingParams

    model, tok = tiny
    ex = BatchExecutor(model, tok, prefill_chunk=None)
    ex.tick([Admit(0, [65] * 300, SamplingParams(max_tokens=1))], [])  # all shapes new
    assert ex.prefill.cold_chunk and ex.policy.rate == ex.policy.rate_last > 0
    ex.policy.rate = high = 1e12
    ex.tick([Admit(1, [66] * 301, SamplingParams(max_tokens=1))], [])  # a new length
    assert ex.prefill.cold_chunk and ex.policy.rate == high
    ex.close()


def test_joiner_chunks_are_bucketed_beside_a_running_row(tiny, arun):
    """While a row decodes, joiners prefill in widths that are multiples of 64 (a
    group's whole width in one forward, or power-of-two chunks of it), whatever their prompt lengths: backends that set up kernels per
    shape (cuDNN attention on CUDA) then reuse them from run to run. (A row continuing
    from a reused prefix prefills its exact remainder; the prefix store is off here.)"""
    widths = []

    inner, tok = tiny

    class Spy:
        on = False  # counts only once the first row decodes

        def __call__(self, x, cache=None):
            if self.on and x.shape[1] > 1:
                widths.append(x.shape[1])
            return inner(x, cache=cache)

        def __getattr__(self, name):
            return getattr(inner, name)

    async def main():
        spy = Spy()
        eng = Engine((spy, tok), kv_budget=None, prefill_chunk=None, prefix_cache=None)
        a = eng.submit("abc", chat=False, max_tokens=200)
        while a.state != "decode":
            await asyncio.sleep(0.001)
        spy.on = True
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


def test_auto_prefill_beside_decode_stays_within_the_step_budget(tiny, arun, monkeypatch):
    """Many short joiners: a chunk is at least one 64-token bucket per row, so groups
    beside a running batch hold at most budget / 64 rows."""
    monkeypatch.setattr(PrefillPolicy, "step_budget", lambda self: 512)

    async def main():
        eng = Engine(tiny, kv_budget=None, prefix_cache=None, max_batch=64)
        a = eng.submit("abc", chat=False, max_tokens=300)
        while a.state != "decode":
            await asyncio.sleep(0.001)
        joiners = [eng.submit("j" * 50 + str(i), chat=False, max_tokens=2) for i in range(40)]
        for r in joiners:
            await r
        eng.cancel_all()
        await eng.aclose()
        return eng.steps

    steps = arun(main)
    beside = [s.prefill_tokens for s in steps if s.batch_size and s.prefill_tokens]
    assert beside and max(beside) <= 512, beside


def test_kv_bound_holds_when_idle_chunks_change_size(tiny):
    """The idle budget follows a measured rate, so chunk sizes change between ticks;
    the buffers must still fit kv_bytes_for (the admission bound)."""
    from mlxnb.core.messages import Admit
    from mlxnb.core.rows import SamplingParams

    model, tok = tiny
    for chunk in (512, None):
        ex = BatchExecutor(model, tok, prefill_chunk=chunk)
        n = 1538
        admits = [Admit(i, [65 + i] * n, SamplingParams(max_tokens=1)) for i in range(8)]
        per_token = sum(b for b, _, _ in ex.setup.layer_costs)
        for i, budget in enumerate([512, 8192, 512, 1024, 8192, 8192]):
            ex.policy.rate_last = budget / 0.25  # the idle tick's budget
            ex.tick(admits if i == 0 else [], [])
            for g in ex.prefill.groups():
                slots = g.cache[0].keys.shape[2] if g.cache[0].keys is not None else 0
                assert slots * per_token <= ex.setup.kv_bytes_for(n + 1), (chunk, i, slots)
        ex.close()


@pytest.mark.integration
def test_a_forked_child_can_make_an_engine(tmp_path):
    """The MLX worker thread is shared per process; a fork must not inherit a dead one."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    script = tmp_path / "fork.py"
    script.write_text(
        "import asyncio, os, signal, mlxnb\n"
        "from mlxnb.models.tiny import tiny_model\n"
        "tiny = tiny_model()\n"
        "mlxnb.Engine(tiny, kv_budget=None, loop=asyncio.new_event_loop())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)\n"
        "    async def main():\n"
        "        eng = mlxnb.Engine(tiny, kv_budget=None)\n"
        "        r = await eng.submit('hi', chat=False, max_tokens=3)\n"
        "        return r.finish_reason  # (mx.clear_cache hangs in a forked child)\n"
        "    ok = asyncio.run(main()) in ('stop', 'length')\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_status_shows_the_prefill_budget(tiny, arun):
    async def main():
        auto = Engine(tiny, kv_budget=None)
        fixed = Engine(tiny, kv_budget=None, prefill_chunk=96)
        out = auto.status(), fixed.status(), auto.worker_state().prefill_chunk
        await auto.aclose()
        await fixed.aclose()
        return out

    auto, fixed, budget = arun(main)
    # sized from the prefill rate the warm-up measured
    assert AUTO_MIN <= budget <= AUTO_MAX and budget == pow2_floor(budget)
    assert f"prefill {budget} tokens/step (auto)" in auto
    assert "prefill 96 tokens/step (fixed)" in fixed
