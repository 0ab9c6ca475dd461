"""Engine.trace: the timing hooks a profiler takes instead of patching the engine."""

import pytest

from mlxnb import Engine


def test_trace_reports_every_part_of_a_tick_and_can_be_turned_off(tiny, arun):
    seen = {}

    def tracer(name, value):
        seen[name] = seen.get(name, 0) + value

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        eng.trace(tracer)
        await eng.generate(["hello there", "abc"], max_tokens=6, chat=False)
        counted = dict(seen)
        eng.trace(None)
        await eng.generate(["more"], max_tokens=4, chat=False)
        await eng.aclose()
        return counted

    counted = arun(main)
    for part in ("tick", "filter", "join", "align", "launch", "launch.fwd_build",
                 "launch.sample", "launch.async_eval", "prefill", "prefill.group",
                 "prefill.fwd_build", "prefill.eval", "read.wait", "read.accept",
                 "read.py", "kv_report", "apply"):
        assert counted.get(part, 0) > 0, part
    assert counted["n.groups"] >= 1 and counted["n.group_rows"] == 2
    assert counted["n.emitted"] >= 12 and counted["n.decoded"] > 0
    assert seen == counted  # off: nothing more reported


@pytest.mark.parametrize("way,parts", [
    ("sync", ("verify.propose", "verify.fwd_build", "verify.sample", "verify.wait",
              "verify.take", "verify.rollback", "verify.align")),
    ("wide", ("wide.propose", "wide.fwd_build", "wide.sample_roll", "wide.async_eval",
              "wide.read_wait", "wide.take"))])
def test_verifying_steps_report_their_parts_and_tracing_changes_no_token(tiny, arun, way,
                                                                         parts):
    seen = {}

    def tracer(name, value):
        seen[name] = seen.get(name, 0) + value

    prompts = ["abc abc abc abc the cat", "hello world hello world hello"]

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        eng._exec.spec.times.only = way
        kw = dict(max_tokens=24, chat=False, speculate="lookup", num_draft=4)
        plain = [r.tokens for r in await eng.generate(prompts, **kw)]
        eng.trace(tracer)
        traced = await eng.generate(prompts, **kw)
        eng.trace(None)
        await eng.aclose()
        return plain, traced

    plain, traced = arun(main)
    assert sum(r.draft_proposed for r in traced) > 0  # it did verify
    assert [r.tokens for r in traced] == plain
    for part in parts:
        assert seen.get(part, 0) > 0, part
    assert seen["n.width"] >= 2
