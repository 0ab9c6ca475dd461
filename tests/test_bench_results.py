"""Benchmark result files are named by the date they were measured and the hardware."""

import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
NAME = re.compile(r"^[a-z-]+-(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$")


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*")), ids=lambda p: p.name)
def test_a_result_file_is_named_by_its_date_and_hardware(path):
    m = NAME.match(path.name)
    assert m, f"{path.name}: want <result>-<YYYY-MM-DD>-<hardware>.md"
    assert m.group(1) in path.read_text()[:400], f"{path.name}: its date is not in its header"


def test_a_new_result_file_takes_todays_date_unless_named_whole():
    import datetime

    from bench.common import stamp

    today = datetime.date.today().isoformat()
    assert stamp("h200") == f"{today}-h200"
    assert stamp("cpu-2core") == f"{today}-cpu-2core"
    assert stamp("2026-12-04-h200") == "2026-12-04-h200"  # named whole


def test_a_decode_window_counts_the_tokens_its_steps_computed(tiny, arun):
    """Each of the window's steps launched one token per row, in the time it records
    (the engine reads a step's tokens a step later, so reads alone would miss one)."""
    import numpy as np

    import mlxnb
    from bench import common

    B, n = 4, 24

    async def main():
        eng = mlxnb.Engine(tiny, kv_budget=None, warmup=False, streak_s=0.0)
        prompts = common.make_prompts(np.random.default_rng(0), B, 16, 250)
        _, steps, _, ok = await common.engine_run(eng, prompts, n)
        await eng.aclose()
        return steps, ok

    steps, ok = arun(main)
    w = common.decode_window(steps, B)
    assert ok and sum(s.tokens for s in steps) == B * n
    assert w["nsteps"] >= n - 2 and w["tokens"] == w["nsteps"] * B
