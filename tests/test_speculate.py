"""Speculative decoding (prompt lookup) in the running batch: exactness, rollback,
the rejection rule's distribution, and what rows report."""

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)

import math

import mlx.core as mx
import numpy as np
import pytest
from test_sampling import SMALL, assert_distribution, reference

from mlxnb import Engine
from mlxnb.core.worker.lookup import RowLookup
from mlxnb.core.worker.sampling import BatchSampler
from mlxnb.core.worker.verify import accept_drafts
from mlxnb.models.tiny import tiny_model

# Random-weight models fall into loops that the n-gram lookup catches, and these
# prompts repeat themselves: drafts get proposed and accepted.
PROMPTS = ["abc abc abc abc the cat", "hello world hello world hello",
           "The quick brown fox jumps over the lazy dog. The quick", "xyz"]
N = 40


@pytest.fixture(scope="module")
def tiny128():
    """Head dim 32: its KV quantizes at group size 32."""
    return tiny_model(hidden=128, heads=4)


async def _run(eng, prompts, spec, batched, **kw):
    if spec:  # a fixed draft length: verified whatever the cost model says
        kw.setdefault("num_draft", 4)
    kw.setdefault("max_tokens", N)
    if batched:
        rows = [eng.submit(p, chat=False, speculate=spec, **kw) for p in prompts]
        return [await r for r in rows]
    return [await eng.submit(p, chat=False, speculate=spec, **kw) for p in prompts]


def _parity(model, arun, way=None, **engine_kw):
    async def main():
        eng = Engine(model, kv_budget=None, warmup=False, **engine_kw)
        eng._exec.spec.times.only = way  # pipelined ("wide") or read back ("sync")
        base = [r.tokens for r in await _run(eng, PROMPTS, None, batched=False)]
        alone = await _run(eng, PROMPTS, "lookup", batched=False)
        batched = await _run(eng, PROMPTS, "lookup", batched=True)
        await eng.aclose()
        return base, alone, batched

    base, alone, batched = arun(main)
    assert [r.tokens for r in alone] == base
    assert [r.tokens for r in batched] == base
    # the runs did speculate: some drafts held (else this tests nothing)
    assert sum(r.draft_accepted for r in alone) > 0
    assert sum(r.draft_accepted for r in batched) > 0
    assert all(r.draft_accepted <= r.draft_proposed for r in alone + batched)
    return alone, batched


@pytest.mark.parametrize("way", [None, "wide", "sync"])
def test_greedy_lookup_is_token_identical_alone_and_batched(tiny, arun, way):
    _parity(tiny, arun, way)


def test_greedy_lookup_is_token_identical_with_sliding_windows(tiny_swa, arun):
    # window 16, 40 tokens: verification and rollback cross the window
    _parity(tiny_swa, arun)


@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_lookup_is_token_identical_with_quantized_kv(tiny128, arun, bits):
    _parity(tiny128, arun, kv_bits=bits, kv_group_size=32)


def test_sliding_window_quantized_kv(arun):
    _parity(tiny_model(hidden=128, heads=4, sliding_window=16), arun, kv_bits=4,
            kv_group_size=32)


def test_drafted_tokens_are_marked_and_counted(tiny, arun):
    alone, _ = _parity(tiny, arun)
    for r in alone:
        assert len(r.tokens) == N  # max_tokens holds exactly
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        row = eng.submit(PROMPTS[1], max_tokens=N, chat=False, speculate="lookup",
                         num_draft=4)
        await row
        run = eng.generate(PROMPTS[:2], max_tokens=N, chat=False, speculate="lookup",
                           num_draft=4)
        await run
        steps = list(eng.steps)
        await eng.aclose()
        return row, run, steps

    row, run, steps = arun(main)
    assert len(row.drafted) == row.draft_accepted > 0
    assert all(0 <= i < len(row.tokens) for i in row.drafted)
    spans = row.drafted_spans
    assert spans and all(0 <= a < b <= len(row.text) for a, b in spans)
    assert all(spans[i][1] < spans[i + 1][0] for i in range(len(spans) - 1))
    from mlxnb.notebook.rowwire import draft_fields as _draft_fields
    assert _draft_fields(row) == {"draft": [row.draft_accepted, row.draft_proposed]}
    df = run.records()
    assert all("draft_accepted" in d and "draft_proposed" in d for d in df)
    assert sum(d["draft_accepted"] for d in df) > 0
    # a verifying step emits more tokens than it has rows
    assert any(s.accepted > 0 and s.tokens > s.batch_size for s in steps)
    assert sum(s.accepted for s in steps) == row.draft_accepted + sum(
        d["draft_accepted"] for d in df)


def test_stop_strings_eos_and_logprobs_hold(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        out = {}
        for spec in (None, "lookup"):
            out[spec] = await _run(eng, PROMPTS, spec, batched=True, stop=["he"],
                                   logprobs=3)
        await eng.aclose()
        return out

    out = arun(main)
    for a, b in zip(out[None], out["lookup"]):
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
        assert len(b.logprobs) == len(b.tokens)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["token"] == y["token"]
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]


@pytest.mark.parametrize("way", ["wide", "sync"])
def test_stop_strings_and_max_tokens_hold_in_either_way(tiny, arun, way):
    """Without logprobs a batch may verify pipelined: tokens taken past a stop
    string, the end of sequence or max_tokens are dropped as they are read."""
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        eng._exec.spec.times.only = way
        out = {}
        for spec in (None, "lookup"):
            out[spec] = await _run(eng, PROMPTS, spec, batched=True, stop=["he"])
            out[spec, 7] = await _run(eng, PROMPTS, spec, batched=True, max_tokens=7)
        wide = eng._exec.spec.wide
        await eng.aclose()
        return out, wide

    out, wide = arun(main)
    for key in (None, 7):
        a_runs, b_runs = (out[None], out["lookup"]) if key is None else (
            out[None, 7], out["lookup", 7])
        for a, b in zip(a_runs, b_runs):
            assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
    assert all(len(r.tokens) <= 7 for r in out["lookup", 7])
    assert (wide > 0) == (way == "wide")


def test_a_seeded_sampled_row_is_the_same_alone_batched_and_without_speculation(tiny, arun):
    kw = dict(temperature=0.3, top_p=0.95, seed=7)

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        base = await _run(eng, PROMPTS, None, batched=False, **kw)
        alone = await _run(eng, PROMPTS, "lookup", batched=False, **kw)
        # beside greedy rows and rows of other seeds
        rows = [eng.submit(p, max_tokens=N, chat=False, speculate="lookup", num_draft=3,
                           **kw) for p in PROMPTS]
        others = [eng.submit(p, max_tokens=N, chat=False, speculate="lookup",
                             temperature=1.0, seed=99) for p in PROMPTS]
        batched = [await r for r in rows]
        for r in others:
            await r
        await eng.aclose()
        return base, alone, batched

    base, alone, batched = arun(main)
    assert [r.tokens for r in alone] == [r.tokens for r in base]
    assert [r.tokens for r in batched] == [r.tokens for r in base]
    assert sum(r.draft_accepted for r in alone) > 0


def test_pipelined_verification_trims_padding_and_stays_identical(tiny, arun):
    """Verifications launched without a read (wide.py) roll rejected positions into
    left padding on the device; long rows gather enough of it to be trimmed."""
    long = 160

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        eng._exec.spec.times.only = "wide"
        base = [(await eng.submit(p, max_tokens=long, chat=False)).tokens
                for p in PROMPTS[:3]]
        rows = [eng.submit(p, max_tokens=long, chat=False, speculate="lookup",
                           num_draft=6) for p in PROMPTS[:3]]
        res = [await r for r in rows]
        spec = eng._exec.spec
        await eng.aclose()
        return base, res, spec

    base, res, spec = arun(main)
    assert [r.tokens for r in res] == base
    assert all(len(r.tokens) == long for r in res)  # max_tokens holds exactly
    assert spec.wide > 0 and spec.trims > 0
    assert sum(r.draft_accepted for r in res) > 0


@pytest.mark.parametrize("way", ["wide", "sync"])
def test_rows_joining_mid_run_in_a_mixed_batch_keep_their_tokens(tiny, arun, way):
    """Greedy speculating rows, rows without speculation and seeded sampled rows
    share the batch, and rows join while verifications are in flight: every row
    gets the tokens it gets alone without speculation."""
    import asyncio

    kinds = [dict(speculate="lookup", num_draft=4), dict(speculate=None),
             dict(speculate="lookup", temperature=0.7, seed=3), dict(speculate="lookup")]

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False, streak_s=0)
        eng._exec.spec.times.only = way
        base = []
        for p, kw in zip(PROMPTS, kinds):
            kw = {**kw, "speculate": None}
            base.append((await eng.submit(p, max_tokens=N, chat=False, **kw)).tokens)
        first = eng.submit(PROMPTS[0], max_tokens=N, chat=False, **kinds[0])
        while sum(s.drafted for s in eng.steps) == 0:  # verifications under way
            await asyncio.sleep(0)
        late = [eng.submit(p, max_tokens=N, chat=False, **kw)
                for p, kw in zip(PROMPTS[1:], kinds[1:])]
        res = [await first] + [await r for r in late]
        await eng.aclose()
        return base, res, len(first.tokens)

    base, res, _ = arun(main)
    assert [r.tokens for r in res] == base
    assert res[0].draft_accepted > 0 and res[1].draft_proposed == 0


class _Scrambled:
    """A draft source that proposes what the target will say, with a token changed
    here and there, and junk: whatever it proposes, outputs must not change."""

    mode = "lookup"

    def __init__(self, refs):
        self.refs = refs  # prompt's first token -> reference output

    def attach(self, row, ids):
        from mlxnb.core.worker.specpolicy import RowPolicy

        class State(RowPolicy):
            def __init__(s):
                super().__init__(row.params.num_draft)
                s.taken, s.ref = [], self.refs[tuple(ids)]

            def extend(s, toks):
                s.taken.extend(toks)

        return State()

    def propose(self, rows, limits, after):
        out = []
        for r, n, a in zip(rows, limits, after):
            st = r.spec
            pos = len(st.taken) + len(a)
            d = list(st.ref[pos:pos + n])
            if len(d) > 2 and pos % 3 == 0:
                d[2] = (d[2] + 1) % 256  # a wrong draft after two right ones
            if pos % 7 == 0:
                d = [(x * 31 + 7) % 256 for x in d]  # junk
            out.append(d)
        return out


@pytest.mark.parametrize("way", ["wide", "sync"])
def test_any_draft_source_leaves_greedy_output_identical(tiny, arun, way):
    """The verifier's rule, not the drafts, decides the tokens: a source proposing
    right, wrong and junk drafts (through the documented interface) changes
    nothing, alone or batched, and its right drafts are taken."""
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        base = [await eng.submit(p, max_tokens=N, chat=False) for p in PROMPTS]
        refs = {tuple(eng.encode(p, chat=False)): r.tokens for p, r in zip(PROMPTS, base)}
        eng._exec.spec.register(_Scrambled(refs))
        eng._exec.spec.times.only = way
        # given draft lengths: verified whatever the host's timings say (the guard's
        # judgement is tested apart), so right drafts are sure to be offered
        alone = [await eng.submit(p, max_tokens=N, chat=False, speculate="lookup",
                                  num_draft=3) for p in PROMPTS]
        rows = [eng.submit(p, max_tokens=N, chat=False, speculate="lookup", num_draft=5)
                for p in PROMPTS]
        batched = [await r for r in rows]
        await eng.aclose()
        return base, alone, batched

    base, alone, batched = arun(main)
    for got in (alone, batched):
        assert [r.tokens for r in got] == [r.tokens for r in base]
        assert sum(r.draft_accepted for r in got) > 0
        assert sum(r.draft_accepted for r in got) < sum(r.draft_proposed for r in got)


def test_a_row_cancelled_mid_verification_leaves_the_others(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False, streak_s=0)
        base = [r.tokens for r in await _run(eng, PROMPTS, None, batched=False)]
        rows = [eng.submit(p, max_tokens=N, chat=False, speculate="lookup", num_draft=4)
                for p in PROMPTS]
        # cancel row 1 once verification steps have run with it in the batch
        while sum(s.drafted for s in eng.steps) == 0 or len(rows[1].tokens) < 8:
            await __import__("asyncio").sleep(0)
        rows[1].cancel()
        res = [await r for r in rows]
        await eng.aclose()
        return base, res

    base, res = arun(main)
    assert res[1].finish_reason == "cancelled"
    assert base[1][:len(res[1].tokens)] == res[1].tokens
    for i in (0, 2, 3):
        assert res[i].tokens == base[i]


def test_constrained_rows_stay_valid_and_do_not_draft(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        base = [await eng.submit(p, max_tokens=N, chat=False, regex="(ab )+(ab)?")
                for p in PROMPTS[:2]]
        rows = [eng.submit(p, max_tokens=N, chat=False, speculate="lookup",
                           regex="(ab )+(ab)?") for p in PROMPTS[:2]]
        free = eng.submit(PROMPTS[1], max_tokens=N, chat=False, speculate="lookup",
                          num_draft=4)
        res = [await r for r in rows] + [await free]
        await eng.aclose()
        return base, res

    base, res = arun(main)
    for a, r in zip(base, res[:2]):
        assert r.draft_proposed == 0 and r.tokens == a.tokens
        assert r.text and set(r.text) <= set("ab ")
    assert res[2].draft_accepted > 0


def test_recurrent_state_models_do_not_speculate_and_say_so(arun):
    from test_cache_kinds import model_for

    from mlxnb.models.tiny import byte_tokenizer

    async def main():
        eng = Engine((model_for("mamba2"), byte_tokenizer()), kv_budget=None,
                     warmup=False)
        base = await eng.submit(PROMPTS[1], max_tokens=16, chat=False)
        spec = await eng.submit(PROMPTS[1], max_tokens=16, chat=False, speculate="lookup")
        status = eng.status()
        await eng.aclose()
        return base, spec, status, eng.speculation

    base, spec, status, facts = arun(main)
    assert spec.tokens == base.tokens and spec.draft_proposed == 0
    assert facts.startswith("off: recurrent-state")
    assert "speculation off: recurrent-state" in status


def test_bad_speculation_options_are_one_line_errors(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        errs = []
        for kw in (dict(speculate="ngram"), dict(speculate="draft"),
                   dict(num_draft=-1), dict(num_draft=99), dict(num_draft=2.5)):
            with pytest.raises(ValueError) as e:
                eng.submit("x", **kw)
            errs.append(str(e.value))
        await eng.aclose()
        return errs

    errs = arun(main)
    assert all("\n" not in e for e in errs)
    assert "speculate must be 'lookup', 'draft' or None" in errs[0]
    assert "needs an engine with a draft model" in errs[1]
    assert all("num_draft" in e for e in errs[2:])
    with pytest.raises(ValueError, match="speculate"):
        Engine(tiny, speculate="yes", warmup=False)


def test_engine_default_speculation_and_num_draft(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False, speculate="lookup")
        on = await eng.submit(PROMPTS[1], max_tokens=N, chat=False, num_draft=2)
        off = await eng.submit(PROMPTS[1], max_tokens=N, chat=False, speculate=None)
        fixed = await eng.submit(PROMPTS[1], max_tokens=N, chat=False, num_draft=1)
        await eng.aclose()
        return on, off, fixed

    on, off, fixed = arun(main)
    assert on.tokens == off.tokens == fixed.tokens
    assert on.draft_proposed > 0 and off.draft_proposed == 0
    assert on.params["speculate"] == "lookup" and off.params["speculate"] is None
    assert on.params["num_draft"] == 2
    # one draft per verification: never more accepted than verifications
    assert 0 < fixed.draft_accepted <= fixed.draft_proposed


# -- the n-gram lookup and its policy ---------------------------------------------------

def test_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    lk = RowLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3], num_draft=3)
    # last 3 tokens (6, 2, 3) never occurred before; (2, 3) last before at index 6
    assert lk.draft(10) == [7, 8, 6]
    assert lk.draft(2) == [7, 8]  # the limit (max_tokens left) caps it
    lk.extend([7])
    assert lk.draft(10) == [8, 6, 2]  # (2, 3, 7) at 6..8
    assert RowLookup([1, 2, 3], num_draft=3).draft(10) == []


def test_a_row_whose_drafts_fail_pauses_for_longer_each_time():
    lk = RowLookup([5, 6, 5, 6, 5, 6], num_draft=0)
    pauses = []
    for _ in range(3):
        lk.verified(4, 0)
        lk.verified(4, 0)
        pauses.append(lk.pause)
        for _ in range(pauses[-1]):
            assert lk.draft(10) == []
            assert lk.paused()
        assert not lk.paused() and lk.draft(10) == [5]  # k shrank to 1
    assert pauses[0] > 0 and pauses[1] == 2 * pauses[0] and pauses[2] == 2 * pauses[1]
    lk.verified(4, 4)
    assert lk.k > 1 and lk.next_pause == pauses[0]


# -- the rejection rule: the target distribution is kept --------------------------------

CONFIGS = {"T=1 draft=top": (dict(temp=1.0), 0),
           "T=0.7 top_p=0.8 draft=5": (dict(temp=0.7, top_p=0.8), 3),
           "T=1.5 top_k=4 draft outside": (dict(temp=1.5, top_k=4), 9)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verified_point_drafts_keep_the_rows_distribution(name):
    """Rows verify a point-mass draft x at position 0 of a 2-wide forward: the
    emitted token follows p, x is accepted with probability p(x), and a rejected
    draft's token follows p with x removed, renormalised."""
    cfg, x = CONFIGS[name]
    p = reference(SMALL, **cfg)
    rows, steps, W = 4096, 6, 2
    s = BatchSampler()
    s.extend([cfg["temp"]] * rows,
              [(cfg.get("top_k", 0), cfg.get("top_p", 1.0), 0.0)] * rows,
              list(range(rows)), [0] * rows)
    logits = mx.broadcast_to(mx.array(SMALL)[None, None], (rows, W, SMALL.size))
    drafts = mx.full((rows, W - 1), x, dtype=mx.int32)
    first, acc_all = [], []
    for _ in range(steps):
        toks = s.sample_wide(logits, keep=False)
        acc, _ = accept_drafts(toks, drafts)
        s.advance(acc + 1)
        mx.eval(toks, acc)
        first.append(np.array(toks[:, 0]))
        acc_all.append(np.array(acc))
    first = np.concatenate(first).astype(np.int64)
    acc = np.concatenate(acc_all)
    n = acc.size
    assert_distribution(first, p, name)
    # acceptance: binomial(n, p(x)), within 4.5 sd (or never, where p(x) = 0)
    if p[x] == 0:
        assert acc.sum() == 0
    else:
        sd = math.sqrt(n * p[x] * (1 - p[x]))
        assert abs(acc.sum() - n * p[x]) < 4.5 * sd
    rest = p.copy()
    rest[x] = 0
    rest /= rest.sum()
    assert_distribution(first[acc == 0], rest, name + " (rejected)")


# -- the step policy --------------------------------------------------------------------

def _times(a, b, B=(1, 8), plain_extra=0.0):
    """Step times a + b * (rows x width) seconds, plain steps `plain_extra` more."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    for rows in B:
        t.observe_plain(rows, a + b * rows + plain_extra)
        for w in (2, 5):
            t.observe_spec(rows, w, a + b * rows * w, rows)
    return t


def test_width_follows_the_cost_of_a_step_and_the_rows_acceptance():
    from mlxnb.core.worker.steptimes import best_width

    host_bound, compute_bound = _times(0.005, 0.0), _times(0.09, 0.013)
    # a step costs the same whatever it feeds: verify every draft
    assert best_width(host_bound, [0.2], [6]) == 7
    # each position costs: a draft that rarely holds is not worth its position
    assert best_width(compute_bound, [0.05] * 8, [4] * 8) == 1
    assert best_width(compute_bound, [0.95], [4]) > 1
    # one row's drafts do not pay for widening seven others
    assert best_width(compute_bound, [0.6] + [0.0] * 7, [4] + [0] * 7) == 1
    # a verification that waits for the step in flight costs more than the
    # pipelined plain step: drafts must make up for the lost overlap
    waits = _times(0.005, 0.0, plain_extra=-0.003)  # plain 2 ms, verify 5 ms
    assert best_width(waits, [0.3], [4]) == 1
    assert best_width(waits, [0.9], [8]) == 9


def test_nothing_measured_tries_a_verification_and_then_measures_it():
    from mlxnb.core.worker.steptimes import StepTimes, best_width

    t = StepTimes()
    t.skip_first = False
    assert best_width(t, [0.5], [4]) == 5  # nothing known: try the drafts
    t.observe_plain(1, 0.010)
    assert t.verify_s(1, 5) == 0.010  # no verification measured: a plain step's cost
    t.observe_spec(1, 5, 0.030, 2)
    assert t.verify_s(1, 9) == 0.030 and t.verify_s(1, 5) == 0.030
    t.observe_spec(1, 3, 0.020, 2)
    assert t.verify_s(1, 9) == pytest.approx(0.050)  # the line through widths 3 and 5
    t.observe_spec(1, 4, 0.500, 2)  # one step while the host was busy
    assert t.verify_s(1, 4) < 0.25  # a line through three widths: not ruled out for good


def test_a_batch_size_not_measured_yet_takes_the_nearest_measured_ones_costs():
    """A batch loses its rows one by one as they end; each new size would otherwise
    start by verifying its widest drafts blind, on a CPU the dearest step of all."""
    from mlxnb.core.worker.steptimes import StepTimes, best_width

    t = StepTimes()
    t.skip_first = False
    # 8 rows on a CPU: each position costs (W5 2.2x a plain step, W13 4.3x)
    t.observe_plain(8, 0.138)
    for w, s in ((3, 0.21), (5, 0.30), (13, 0.59)):
        t.observe_spec(8, w, s, 8)
    t.observe_plain(1, 0.075)
    assert t.nearest(7) == 8 and t.nearest(4) == 8 and t.nearest(2) == 1  # by ratio
    w7 = best_width(t, [0.8] * 7, [12] * 7)
    assert 1 < w7 < 8  # not 13: narrow, as at 8 rows
    assert w7 == best_width(t, [0.8] * 8, [12] * 8)
    assert best_width(StepTimes(), [0.8] * 7, [12] * 7) == 13  # nothing measured at all


def test_a_narrow_widths_stale_cost_does_not_outweigh_wider_ones_measured_cheap():
    """Verify times as a host-bound GPU's policy held them: narrow widths last
    measured on a busy host, wider ones since measured at about a plain step's
    cost. A fresh row (q = 0.5) must still be worth verifying: drafts that are
    never verified never teach the row its acceptance."""
    from mlxnb.core.worker.steptimes import StepTimes, best_width

    t = StepTimes()
    t.skip_first = False
    t.observe_plain(1, 0.0069)
    for w, ms in ((2, 27.7), (4, 19.5), (5, 9.5), (7, 17.1), (9, 14.6), (11, 9.1)):
        t.observe_spec(1, w, ms / 1e3, 2)
    assert t.verify_s(1, 2) == t.verify_s(1, 11) == pytest.approx(0.0091)
    assert best_width(t, [0.5], [4]) > 1
    # costs that rise with width (a compute-bound CPU) are kept, and interpolated
    c = StepTimes()
    c.skip_first = False
    for w, ms in ((2, 175), (5, 260), (8, 376)):
        c.observe_spec(1, w, ms / 1e3, 2)
    assert c.verify_s(1, 3) == pytest.approx(0.175 + 0.085 / 3)
    assert c.verify_s(1, 11) > c.verify_s(1, 8) == pytest.approx(0.376)
    # narrower than any measured: between a plain step's cost and the narrowest
    n = StepTimes()
    n.skip_first = False
    n.observe_plain(8, 0.100)
    n.observe_spec(8, 5, 0.200, 8)
    assert n.verify_s(8, 3) == pytest.approx(0.150) and n.verify_s(8, 5) == 0.200


def test_a_joining_row_starts_from_the_acceptance_of_the_rows_before_it():
    """Where a verification costs two plain steps, a row from an even prior is
    never verified, so it would never learn that it copies; it starts instead
    from what its source's rows showed, good or bad."""
    from mlxnb.core.worker.specpolicy import Pooled, RowPolicy
    from mlxnb.core.worker.steptimes import StepTimes, best_width

    t = StepTimes()
    t.skip_first = False
    t.observe_plain(1, 0.007)
    t.observe_spec(1, 5, 0.014, 3)
    pool = Pooled()
    assert RowPolicy(pool=pool).q == 0.5
    assert best_width(t, [0.5], [4], [0.5]) == 1
    for _ in range(4):
        r = RowPolicy(pool=pool)
        for _ in range(8):
            r.verified(4, 3)
    joined = RowPolicy(pool=pool)
    assert 0.7 < joined.q < 0.76 and best_width(t, [joined.q], [4], [joined.q]) > 1
    for _ in range(40):
        RowPolicy(pool=pool).verified(4, 0)
    assert RowPolicy(pool=pool).q < 0.3
    assert RowPolicy().q == 0.5  # a source without a pool: the even prior


def test_the_guard_turns_speculation_off_where_it_measures_slower_and_retries():
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    t.observe_plain(8, 0.010)  # 800 tok/s plain
    for _ in range(StepTimes.MIN_SPEC - 1):
        t.observe_spec(8, 5, 0.020, 15)  # 750 tok/s speculating: slower
        assert t.allowed(8)
    t.observe_spec(8, 5, 0.020, 15)
    holds = []
    for _ in range(2):  # off for a hold, then tried again; the next hold is longer
        n = 0
        while not t.allowed(8):
            n += 1
        holds.append(n)
        for _ in range(StepTimes.MIN_SPEC):
            t.observe_spec(8, 5, 0.020, 15)
    assert holds == [StepTimes.HOLD, 2 * StepTimes.HOLD] and t.holds == 3
    assert t.allowed(1)  # another batch size is judged on its own
    # where it pays, it stays on
    t2 = StepTimes()
    t2.skip_first = False
    t2.observe_plain(8, 0.010)
    for _ in range(50):
        t2.observe_spec(8, 5, 0.020, 17)  # 850 tok/s
        assert t2.allowed(8)
    assert t2.holds == 0


def _regime_run(t, B, steps, verify_s, plain_s, tokens):
    """Feed the guard a step pattern while it lets speculation on: one verification
    (verify_s, `tokens`) then one plain step (plain_s, B tokens), as the engine
    reports them; held steps are plain ones at `plain_s`. Returns the steps held."""
    held = 0
    for i in range(steps):
        if not t.allowed(B):
            held += 1
            t.observe_regime(B, plain_s, B, held=True)
        elif i % 2:
            t.observe_plain(B, plain_s * 1.5)  # as timed between verifications
            t.observe_regime(B, plain_s * 1.5, B, held=False)
        else:
            t.observe_spec(B, 5, verify_s, tokens)
            t.observe_regime(B, verify_s, tokens, held=False)
    return held


def test_the_guard_judges_every_step_against_steps_held_off():
    """Plain steps timed between verifications cost more than plain decoding does
    (the verification emptied the pipeline): judged by its verifying steps against
    those, a speculation that is slower overall looks as if it pays. The guard
    measures a baseline with speculation held off and turns it off."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    # plain: 8 rows in 11.3 ms; with speculation: a verification giving 14 tokens in
    # 17 ms and a plain step slowed to 17 ms: 22 tokens / 34 ms, 0.92x of plain
    held = _regime_run(t, 8, 400, 0.017, 0.0113, 14)
    assert t.holds >= 1 and held > StepTimes.HOLD
    b = t._base[t.group(8)]
    # the baseline: the held steps, a token per row per (inflated) plain average
    assert abs(b[0] / b[1] - 1.5) < 0.01
    # where speculation pays (17 tokens a verification: 1.04x), it is probed once
    # and then stays on
    t2 = StepTimes()
    t2.skip_first = False
    held = _regime_run(t2, 8, 400, 0.017, 0.0113, 17)
    assert t2.holds == 0 and held == StepTimes.PROBE
    # clearly above the plain average (2.3x its rate): no probe at all
    t3 = StepTimes()
    t3.skip_first = False
    assert _regime_run(t3, 8, 400, 0.017, 0.0113, 80) == 0 and t3.holds == 0


def test_the_guard_judges_a_shrinking_wave_by_its_batch_size_group():
    """Waves of 8 rows that end one by one (H200 timings of the bundled model on
    copy prompts: a plain step 11.3 ms at any size, a verification 2.2x that giving
    2.1 tokens a row, the plain steps between slowed 1.7x): no size sees 16 steps in
    a row, yet the guard holds speculation off."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    held = spec = 0
    for wave in range(6):
        for B in (8, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 1):
            for i in range(3):
                if not t.allowed(B):
                    held += 1
                    t.observe_regime(B, 0.0113, B, held=True)
                elif i % 2:
                    t.observe_plain(B, 0.0113 * 1.7)
                    t.observe_regime(B, 0.0113 * 1.7, B, held=False)
                else:
                    spec += 1
                    t.observe_spec(B, 5, 0.0113 * 2.2, round(2.1 * B))
                    t.observe_regime(B, 0.0113 * 2.2, round(2.1 * B), held=False)
    assert t.holds >= 1 and held > spec


def test_the_faster_way_of_verifying_is_kept_and_the_other_tried_again():
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    seen = []
    for _ in range(2 * StepTimes.MIN_SPEC):  # each way tried first
        way = t.way(4)
        seen.append(way)
        t.observe_spec(4, 3, 0.01, 8 if way == "wide" else 6, way)
    assert seen == ["sync"] * StepTimes.MIN_SPEC + ["wide"] * StepTimes.MIN_SPEC
    later = []
    for _ in range(StepTimes.REPROBE + StepTimes.MIN_SPEC):
        way = t.way(4)
        later.append(way)
        t.observe_spec(4, 3, 0.01, 8 if way == "wide" else 6, way)
    # kept the faster, then tried the slower for MIN_SPEC steps
    assert later.count("sync") == StepTimes.MIN_SPEC and later[0] == "wide"
    assert t.way(4) == "wide" and t.way(8) == "sync"  # a new batch size starts over
    # the other way must measure clearly faster before it is chosen
    t2 = StepTimes()
    t2.skip_first = False
    for _ in range(StepTimes.MIN_SPEC):
        t2.observe_spec(1, 3, 0.01, 10, "wide")
    for _ in range(StepTimes.MIN_SPEC):
        t2.observe_spec(1, 3, 0.01, 10.3, "sync")  # 3% faster: noise
    assert t2.way(1) == "sync"  # nothing kept yet: the faster
    for _ in range(StepTimes.MIN_SPEC):
        t2.observe_spec(1, 3, 0.01, 10.4, "wide")  # now 1% faster: noise, kept
    assert t2.way(1) == "sync"
    for _ in range(20):
        t2.observe_spec(1, 3, 0.01, 12.5, "wide")  # 20% faster: switched
    assert t2.way(1) == "wide"


@pytest.mark.parametrize("mask", [None, "causal", "padded"])
def test_verification_attention_matches_the_fused_kernel(mask, monkeypatch):
    """Half-precision attention over several query positions is composed from plain
    ops while a verification is built (no per-shape setup); it computes what MLX's
    fused kernel computes, and single positions keep the fused kernel."""
    from mlx_lm.models.base import create_causal_mask

    from mlxnb.core.worker.wideattn import unfused_attention, wide_attention

    B, Hq, Hkv, L, S, D = 2, 6, 2, 3, 11, 64
    mx.random.seed(1)
    q, k, v = (mx.random.normal(s) for s in ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    m = (create_causal_mask(L, S - L, left_padding=mx.array([0, 4]))
         if mask == "padded" else mask)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
    ours = unfused_attention(q, k, v, 0.125, m)
    assert mx.allclose(ours, fused, atol=1e-5).item()
    half = [x.astype(mx.bfloat16) for x in (q, k, v)]
    import mlxnb.core.worker.wideattn as wa

    calls = []
    monkeypatch.setattr(wa, "unfused_attention",
                        lambda *a, **k: calls.append(a[0].shape) or unfused_attention(*a, **k))
    with wide_attention():
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)  # float32
        routed = mx.fast.scaled_dot_product_attention(*half, scale=0.125, mask=m)
        one = mx.fast.scaled_dot_product_attention(half[0][:, :, :1], *half[1:],
                                                   scale=0.125)
    assert calls == [(B, Hq, L, D)]  # only the half-precision multi-position call
    assert mx.fast.scaled_dot_product_attention is wa._fused  # restored after
    assert mx.array_equal(routed, unfused_attention(*half, 0.125, m)).item()
    assert mx.array_equal(one, mx.fast.scaled_dot_product_attention(
        half[0][:, :, :1], *half[1:], scale=0.125)).item()
    assert mx.allclose(routed.astype(mx.float32), fused, atol=0.05).item()


def test_a_widths_first_verification_is_not_learnt_from():
    """The first verification of a shape pays one-off setup (seconds compiling
    kernels on a GPU); learnt from, it would rule that width out for good."""
    from mlxnb.core.worker.steptimes import StepTimes, best_width

    t = StepTimes()
    t.observe_plain(1, 0.008)
    t.observe_spec(1, 5, 7.7, 3)  # cold
    assert best_width(t, [0.8], [4]) == 5 and t.verify_s(1, 5) == 0.008
    t.observe_spec(1, 5, 0.009, 3)
    assert t.verify_s(1, 5) == 0.009 and best_width(t, [0.8], [4]) == 5


def test_ways_are_judged_by_every_step_while_in_effect():
    """A way whose verifying steps measure faster but which leaves more plain steps
    between them (pipelined drafts going stale) gives fewer tokens per second
    overall: it is the other that is kept."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    for _ in range(4 * StepTimes.MIN_SPEC):
        way = t.way(1)
        if way == "wide":  # 4 tokens per verifying step, then three plain steps
            t.observe_spec(1, 5, 0.010, 4, "wide")
            for _ in range(3):
                t.observe_flow(1, 0.008, 1)
        else:  # 3 tokens per (slower) verifying step, one plain step between
            t.observe_spec(1, 5, 0.012, 3, "sync")
            t.observe_flow(1, 0.008, 1)
    w = t._ways[1]
    assert w["wide"][0] > w["sync"][0]  # by its verifying steps alone: wide
    assert t.way(1) == "sync"  # (7 tokens / 34 ms) < (4 tokens / 20 ms)


def test_a_verification_that_waited_for_the_step_in_flight_is_costed_without_it():
    """A read-back verification drafted ahead waits for the plain step in flight:
    that step's compute is not the verification's cost (else verifying ahead looks
    twice as dear as it is on a device that runs one step at a time)."""
    from mlxnb.core.worker.speculate import Speculation

    sp = Speculation([])
    sp.times.skip_first = False
    sp.times.observe_plain(1, 0.100)
    sp.observe(1, 0.250, (4, 3, 4, 5), drained=True, pipelined=True)
    assert abs(sp.times.verify[1][5] - 0.150) < 1e-9
    sp.observe(1, 0.150, (4, 3, 4, 6), drained=False, pipelined=False)
    assert abs(sp.times.verify[1][6] - 0.150) < 1e-9  # nothing in flight: all its own
    sp.observe(1, 0.120, (4, 3, 4, 7), drained=True, pipelined=True)
    assert abs(sp.times.verify[1][7] - 0.060) < 1e-9  # at least half stays its own


def _shrinking_wave(t) -> int:
    """The step at which the guard first holds speculation off (None: never) in a
    wave of 8 rows on 2-core CPU timings of the bundled model on copy prompts: a
    plain step 115 ms + 13.7 ms a row, a verification 2.03x that giving 1.8 tokens a
    row, the plain steps between at 0.88x; the wave shrinks every few steps, and
    starts with a plain step."""
    t.observe_plain(8, (0.115 + 0.0137 * 8) * 0.88)
    steps = 1
    for B in (8, 8, 8, 8, 7, 7, 7, 6, 6, 6, 5, 5, 5, 5):
        plain = 0.115 + 0.0137 * B
        for i in range(3):
            steps += 1
            if not t.allowed(B):
                t.observe_regime(B, plain, B, held=True)
            elif i:
                t.observe_plain(B, plain * 0.88)
                t.observe_regime(B, plain * 0.88, B, held=False)
            else:
                t.observe_spec(B, 5, plain * 2.03, round(1.8 * B))
                t.observe_regime(B, plain * 2.03, round(1.8 * B), held=False)
            if t.holds:
                return steps
    return None


def test_verifications_that_lose_are_held_off_within_one_shrinking_wave():
    """The first rule (speculating steps against plain ones) by group too: in a wave
    whose size shrinks every few steps no size gathers MIN_SPEC verifications, the
    group does: the guard holds speculation off at the first verification after its
    baseline probe, not a window later."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    t.skip_first = False
    first_hold = _shrinking_wave(t)
    # six verifications (every third step) against the wave's plain steps
    assert first_hold is not None and first_hold <= 20


def test_first_verifications_that_paid_no_setup_are_learnt_from():
    """The same wave with the guard's default of not learning from a shape's first
    verification where it paid setup: these (a CPU's, about two plain steps) did
    not, so they count and the guard holds as soon; a first verification that pays
    seconds of compiling, or a GPU process's loading its kernels, still does not."""
    from mlxnb.core.worker.steptimes import StepTimes

    t = StepTimes()
    assert t.skip_first
    first_hold = _shrinking_wave(t)
    assert first_hold is not None and first_hold <= 20  # (learning from no first: 35)
    cold = StepTimes()
    cold.observe_plain(4, 0.01)
    assert not cold.observe_spec(4, 3, 2.5, 8)  # compiling: not learnt from
    assert cold.observe_spec(4, 3, 0.025, 8)  # the next one is
    assert cold.observe_spec(4, 4, 0.02, 8)  # a first that paid nothing is too
    # an H200 process's first 5-wide verification at B=1: 60 ms against 6.4 ms plain
    gpu = StepTimes()
    gpu.observe_plain(1, 0.0064)
    assert not gpu.observe_spec(1, 5, 0.060, 3)
    assert gpu.observe_spec(1, 5, 0.0068, 3)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_rollback_keeps_each_rows_tokens_in_order_and_the_room_to_grow(lazy):
    """Row b keeps its positions [pad_b, n - rejected_b), in order, ending at the
    write index; its padding grows by what it rejected past the shared part; the
    buffer's room beyond the rolled part is untouched (keys and values alike)."""
    from mlxnb.core.worker.caches import LeanBatchKVCache
    from mlxnb.core.worker.rollback import roll_lazy, rollback

    B, H, n, D = 3, 2, 10, 4
    pads, rejected = [0, 2, 1], [1, 3, 2]
    c = LeanBatchKVCache(list(pads))
    pos = 100 * mx.arange(B)[:, None, None, None] + mx.arange(n)[None, None, :, None]
    keys = mx.broadcast_to(pos.astype(mx.float32), (B, H, n, D))
    c.update_and_fetch(keys, keys + 0.5)
    c.keys[..., n:, :] = -1.0  # the room to grow, marked
    if lazy:
        roll_lazy([c], mx.array(rejected))
        end = n  # the write index stays; everything rejected becomes padding
        shift = rejected
    else:
        rollback([c], rejected)
        end = n - min(rejected)
        shift = [r - min(rejected) for r in rejected]
    assert c._idx == end
    assert c.left_padding.tolist() == [p + s for p, s in zip(pads, shift)]
    k, v = np.array(c.keys), np.array(c.values)
    for b in range(B):
        kept = 100 * b + np.arange(pads[b], n - rejected[b])
        lo = end - len(kept)
        assert lo == c.left_padding.tolist()[b]
        assert (k[b, :, lo:end, :] == kept[None, :, None]).all(), k[b, 0, :end, 0]
        assert (v[b, :, lo:end, :] == kept[None, :, None] + 0.5).all()
    assert k.shape[2] > n and (k[:, :, n:, :] == -1.0).all()


@pytest.mark.parametrize("default,says", [(None, "speculation off by default, rows may ask "
                                                 "lookup"),
                                          ("lookup", "speculation lookup by default, rows "
                                                     "may ask lookup")])
def test_status_says_whether_rows_speculate_by_default(tiny, default, says):
    eng = Engine(tiny, kv_budget=None, warmup=False, speculate=default)
    try:
        assert says in eng.status()
    finally:
        eng.close()
