"""Engine.trace: the timing hooks a profiler takes instead of patching the engine."""

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
