"""Structured rows on the tiny random-weight model: a random model is the harshest
test of a constraint, since nothing but the mask keeps its output valid."""

import json
import re
import time

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxnb import Engine
from mlxnb.core.constraint_params import kind_of
from mlxnb.core.worker.masks import masked

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                 "maxItems": 3},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
LABEL = {"type": "object", "properties": {"label": {"enum": ["pos", "neg", "neutral"]},
                                          "score": {"type": "integer", "minimum": 1,
                                                    "maximum": 5}},
         "required": ["label", "score"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]
LARK = r"""start: "(" NUM ("," NUM)* ")"
NUM: /[0-9]{1,2}/
"""
LARK_RE = r"\([0-9]{1,2}(,[0-9]{1,2})*\)"


def make(tiny, **kw):
    kw.setdefault("kv_budget", None)
    kw.setdefault("warmup", False)
    return Engine(tiny, **kw)


def valid(r) -> bool:
    p = r.params
    if p.json_schema is not None:
        try:
            jsonschema.validate(json.loads(r.text), p.json_schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if p.regex is not None:
        return re.fullmatch(p.regex, r.text) is not None
    if p.choices is not None:
        return r.text in p.choices
    if p.grammar is not None:
        return re.fullmatch(LARK_RE, r.text) is not None
    return True


@pytest.fixture(params=[None, 3], ids=["default-lanes", "3-lanes"])
def lanes(request):
    """The engine's fill lanes: this machine's default, and three (rows spread over
    three compiles and up to three fill threads, as on a machine of 12+ CPUs)."""
    return request.param


def test_64_mixed_rows_in_one_batch_every_stopped_row_is_valid(tiny, arun, lanes):
    async def main():
        eng = make(tiny, max_batch=64, fill_threads=lanes)
        rows = []
        for i in range(64):
            kw = dict(max_tokens=96, temperature=(0.0, 0.7, 1.0, 1.3)[i % 4], seed=i,
                      top_p=0.9 if i % 3 == 0 else 1.0)
            kind = i % 6
            if kind == 0:
                kw["json_schema"] = PERSON
            elif kind == 1:
                kw["json_schema"] = LABEL
            elif kind == 2:
                kw["regex"] = REGEX
            elif kind == 3:
                kw["choices"] = CHOICES
            elif kind == 4:
                kw["grammar"] = LARK
                kw["max_tokens"] = 12
            rows.append(eng.submit(f"row {i}: say something", chat=False, **kw))
        await eng.wait()
        steps = [s.batch_size for s in eng.steps]
        # the verdicts the worker read off each row's matcher, against a fresh
        # matcher reading the finished text
        assert [r.constraint_error for r in rows] == [
            eng.constraints.check(r.params, r.text, r.finish_reason) for r in rows]
        await eng.aclose()
        return rows, steps

    rows, steps = arun(main)
    assert max(steps) == 64  # one batch
    by = {}
    for r in rows:
        by.setdefault(kind_of(r.params), []).append(r)
        assert r.finish_reason in ("stop", "length"), (r.finish_reason, r.error)
        if r.finish_reason == "stop":
            assert valid(r), (r.params, r.text)
        else:
            assert r.ntok == r.params.max_tokens
        # the engine's own check of the finished text agrees with jsonschema / re
        assert r.valid == (valid(r) if kind_of(r.params) else None), (r.params, r.text)
    # The constraints are what end these rows: each kind stops (valid) before its cap.
    for kind in ("json_schema", "regex", "choices"):
        assert all(r.finish_reason == "stop" for r in by[kind]), kind
    assert all(r.json is not None and r.json_error is None for r in by["json_schema"])
    assert all(len(r.tokens) < r.params.max_tokens for r in by["regex"] + by["choices"])
    assert sum(r.finish_reason == "stop" for r in by["grammar"]) >= 3
    # greedy free rows never pick eos on the byte model; they run to their cap
    assert all(r.finish_reason == "length" for r in by[None] if r.params.temperature == 0)


def test_seeded_constrained_row_is_the_same_alone_and_batched(tiny, arun, lanes):
    async def main():
        eng = make(tiny, max_batch=16, fill_threads=lanes)
        kw = dict(json_schema=PERSON, max_tokens=80, temperature=0.9, top_p=0.95, seed=7)
        alone = await eng.submit("the same row", chat=False, **kw)
        greedy = await eng.submit("greedy", chat=False, regex=REGEX, max_tokens=20)
        others = [eng.submit(f"other {i}", chat=False, max_tokens=40,
                             temperature=1.0, seed=i) for i in range(5)]
        others += [eng.submit(f"json {i}", chat=False, json_schema=LABEL, seed=i,
                              temperature=0.5, max_tokens=60) for i in range(4)]
        mid = eng.submit("the same row", chat=False, **kw)
        g2 = eng.submit("greedy", chat=False, regex=REGEX, max_tokens=20)
        await eng.wait()
        await eng.aclose()
        return alone, greedy, mid.result(), g2.result()

    alone, greedy, batched, g2 = arun(main)
    assert alone.finish_reason == "stop" and alone.tokens == batched.tokens
    assert greedy.tokens == g2.tokens and re.fullmatch(REGEX, g2.text)


def test_length_is_honest_and_keeps_the_partial_output(tiny, arun):
    async def main():
        eng = make(tiny)
        r = eng.submit("cut me", chat=False, json_schema=PERSON, max_tokens=5)
        await r
        await eng.aclose()
        return r

    r = arun(main)
    assert r.finish_reason == "length" and r.ntok == 5 and r.text.startswith('{"')
    assert r.json is None and "max_tokens" in r.json_error
    assert r.result().json is None and r.result().json_error == r.json_error


def test_complete_grammar_stops_without_waiting_for_eos(tiny, arun):
    async def main():
        eng = make(tiny)
        r = eng.submit("pick", chat=False, choices=["abc"], max_tokens=50,
                       stop=["zz"])  # a stop-string row is detokenized on the worker
        await r
        await eng.aclose()
        return r

    r = arun(main)
    # the byte model never samples eos; the finished grammar ends the row
    assert (r.finish_reason, r.text, r.ntok) == ("stop", "abc", 3)


def test_a_stop_string_that_cuts_a_constrained_row_leaves_it_not_valid(tiny, arun):
    from mlxnb.core.constraint_results import widget_fields

    async def main():
        eng = make(tiny)
        cut = eng.submit("pick", chat=False, choices=["abc"], max_tokens=50, stop=["b"])
        js = eng.submit("pick", chat=False, json_schema={"enum": [123]}, max_tokens=9,
                        stop=["3"])
        whole = eng.submit("pick", chat=False, choices=["abc"], max_tokens=50)
        await eng.wait()
        await eng.aclose()
        return cut, js, whole

    cut, js, whole = arun(main)
    assert (cut.finish_reason, cut.text, cut.valid) == ("stop", "a", False)
    assert cut.constraint_error == "incomplete: its choices needs more"
    assert widget_fields(cut) == {"con": "choice", "parse": cut.constraint_error}
    assert (whole.finish_reason, whole.valid, widget_fields(whole)["parse"]) == (
        "stop", True, "ok")
    # JSON that parses, but the stop string cut it from the only value allowed
    assert (js.text, js.finish_reason, js.valid, js.json) == ("12", "stop", False, None)
    assert js.json_error == "incomplete: its schema needs more"
    assert whole.result().valid is True and cut.result().valid is False
    assert whole.result().constraint_error is None
    assert cut.result().constraint_error == cut.constraint_error is not None
    from mlxnb.core.run import Run  # and in the records a saved run writes

    recs = Run([cut, whole]).records()
    assert [r["constraint_error"] for r in recs] == [cut.constraint_error, None]


def test_check_names_where_a_text_breaks_its_constraint(tiny):
    from mlxnb.core.constrain import Constraints
    from mlxnb.core.rows import SamplingParams

    cons = Constraints(tiny[1])
    p = SamplingParams(regex=REGEX)
    assert cons.check(p, "AB-123") is None
    assert cons.check(p, "AB-12") == "incomplete: its regex needs more"
    assert cons.check(p, "AB-1x3").startswith("breaks its regex at character 4: 'x3'")
    assert cons.check(SamplingParams(), "anything") is None
    # text that spells a special token is read as text, as the row wrote it
    special = SamplingParams(regex="<eos>|<pad>x")
    assert cons.check(special, "<eos>") is None and cons.check(special, "<pad>x") is None
    assert cons.check(special, "<pad>").startswith("incomplete")
    assert cons.check(SamplingParams(regex="a+"), "a<eos>").startswith(
        "breaks its regex at character 1")


def test_schema_forms_gbnf_and_pandas_columns(tiny, arun):
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=4)
        count: int = pydantic.Field(ge=0, le=9)

    gbnf = 'root ::= "v" [0-9] "." [0-9]'

    async def main():
        eng = make(tiny)
        run = eng.generate(["a", "b"], chat=False, json_schema=Item, max_tokens=60)
        s = eng.submit("c", chat=False, json_schema=json.dumps(LABEL), max_tokens=60)
        g = eng.submit("d", chat=False, grammar=gbnf, max_tokens=10)
        await run
        await s
        await g
        await eng.aclose()
        return run, s, g

    run, s, g = arun(main)
    assert all(r.finish_reason == "stop" for r in run)
    for r in run:
        Item.model_validate(r.json)
    df = run.to_pandas()
    assert {"json.kind", "json.count", "json_error", "constraint"} <= set(df.columns)
    assert list(df["json.count"]) == [r.json["count"] for r in run]
    assert df["json_error"].isna().all() and set(df["constraint"]) == {"json_schema"}
    assert s.finish_reason == "stop" and jsonschema.validate(s.json, LABEL) is None
    assert re.fullmatch(r"v[0-9]\.[0-9]", g.text) and g.finish_reason == "stop"


@pytest.mark.parametrize("kw, words", [
    (dict(regex="a(b"), "regex is invalid"),
    (dict(json_schema={"type": "frobnicate"}), "json_schema is invalid"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema takes a dict"),
    (dict(grammar="start: undefined_rule"), "grammar is invalid"),
    (dict(grammar='root ::= "a" undefined'), "grammar is invalid"),
    (dict(choices="yes"), "list of strings"),
    (dict(choices=[]), "non-empty list"),
    (dict(choices=["a", 3]), "non-empty strings"),
    (dict(regex=""), "non-empty string"),
    (dict(regex="a", choices=["a"]), "at most one"),
])
@pytest.mark.usefixtures("patient_submits")
def test_bad_constraints_raise_one_line_before_submitting(tiny, arun, kw, words):
    async def main():
        eng = make(tiny)
        running = eng.submit("keep going", chat=False, max_tokens=30)
        with pytest.raises(ValueError) as ei:
            eng.submit("x", chat=False, **kw)
        with pytest.raises(ValueError):
            eng.generate(["y", "z"], chat=False, **kw)
        n = len(eng.rows)
        await running
        await eng.aclose()
        return ei.value, n, running

    err, n, running = arun(main)
    assert words in str(err) and "\n" not in str(err), str(err)
    assert n == 1 and running.finish_reason == "length"  # nothing submitted or disturbed


def test_the_submit_wait_starts_once_the_tokenizer_is_built(tiny, arun, monkeypatch):
    """llguidance's view of a real vocabulary takes ~0.4 s to build, once per engine;
    the first constrained submit after load still gets its whole wait for the compile,
    so a bad grammar raises there rather than ending a row."""
    from mlxnb.core import constrain

    build = constrain.Constraints.lltokenizer

    def slow(self):
        if self._llt is None:
            time.sleep(3 * constrain.SUBMIT_WAIT_S)
        return build(self)

    monkeypatch.setattr(constrain.Constraints, "lltokenizer", slow)

    async def main():
        eng = make(tiny)
        with pytest.raises(ValueError, match="grammar is invalid"):
            eng.submit("x", chat=False, grammar="start: undefined_rule")
        n = len(eng.rows)
        await eng.aclose()
        return n

    assert arun(main) == 0


def test_a_stuck_tokenizer_build_holds_a_submit_no_longer_than_the_compile_bound(
        tiny, arun, monkeypatch):
    """The submit's wait for a tokenizer still being built is bounded by the compile's
    own bound; past it the row is queued and runs once its constraint is ready."""
    from mlxnb.core import constrain

    build = constrain.Constraints.lltokenizer
    monkeypatch.setattr(constrain, "COMPILE_TIMEOUT_S", 0.2)

    def stuck(self):
        if self._llt is None:
            time.sleep(2.0)
        return build(self)

    monkeypatch.setattr(constrain.Constraints, "lltokenizer", stuck)

    async def main():
        eng = make(tiny)
        t = time.monotonic()
        row = eng.submit("x", chat=False, regex="[a-z]{3}", max_tokens=8)
        took = time.monotonic() - t
        await row
        await eng.aclose()
        return took, row

    took, row = arun(main)
    assert took < 1.5, took
    assert row.finish_reason == "stop" and re.fullmatch("[a-z]{3}", row.text), row.text


def test_cancel_a_constrained_row_mid_batch(tiny, arun):
    async def main():
        eng = make(tiny)
        a = eng.submit("a", chat=False, json_schema={"type": "string"}, max_tokens=200)
        b = eng.submit("b", chat=False, regex="[a-z]{150}", max_tokens=200)
        while b.ntok < 5 and not b.done:
            await asyncio_sleep()
        b.cancel()
        await a
        await b
        await eng.aclose()
        return a, b

    a, b = arun(main)
    assert b.finish_reason == "cancelled"
    assert a.finish_reason in ("stop", "length")
    assert a.finish_reason == "length" or isinstance(a.json, str)


async def asyncio_sleep():
    import asyncio

    await asyncio.sleep(0.001)


def test_mask_matches_a_numpy_reference_including_padded_vocab():
    rng = np.random.default_rng(0)
    for V, b in ((70, 3), (64, 2), (100, 1)):  # 100 > 96 bits: padded embedding rows
        words = rng.integers(-2**31, 2**31, size=(b, 3), dtype=np.int64).astype(np.int32)
        logits = rng.normal(size=(b, V)).astype(np.float32)
        out = np.array(masked(mx.array(logits), mx.array(words), mx.arange(32, dtype=mx.uint32)))
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)
        want = np.where(np.pad(bits, ((0, 0), (0, max(0, V - 96))))[:, :V], logits, -np.inf)
        np.testing.assert_array_equal(out, want)


def test_the_default_models_tokenizer_works(arun):
    from mlxnb.models.tiny import tiny_model

    tiny = tiny_model(vocab="smollm2")  # the real 49152-token tokenizer, random weights

    async def main():
        eng = make(tiny)
        rows = [eng.submit(f"p{i}", json_schema=LABEL, max_tokens=40, seed=i,
                           temperature=0.8) for i in range(3)]
        rows += [eng.submit("q", regex=REGEX, max_tokens=20),
                 eng.submit("r", choices=CHOICES, max_tokens=20)]
        await eng.wait()
        await eng.aclose()
        return rows

    for r in arun(main):
        assert r.finish_reason in ("stop", "length")
        assert r.finish_reason == "length" or valid(r), r.text


def test_top_k_min_p_and_logprobs_see_only_allowed_tokens(tiny, arun):
    async def main():
        eng = make(tiny)
        rows = [eng.submit("x", chat=False, choices=["ab", "ac", "b"], logprobs=4,
                           max_tokens=5, top_k=3, min_p=0.05, temperature=1.2, seed=s)
                for s in range(6)]
        await eng.wait()
        await eng.aclose()
        return rows

    for r in arun(main):
        assert r.finish_reason == "stop" and r.text in ("ab", "ac", "b")
        first = r.logprobs[0]
        # the distribution sampled from: only 'a' and 'b' can start a choice
        assert {t for t, _ in first["top"]} <= {ord("a"), ord("b")}
        assert all(lp > -1e9 for _, lp in first["top"]) and first["logprob"] <= 0


def test_fill_threads_fill_the_masks_each_matcher_gives_alone(tiny):
    from types import SimpleNamespace

    import llguidance.numpy as lln
    import mlx.core as mx

    from mlxnb.core.worker import masks as masks_mod
    from mlxnb.core.worker.inflight import InFlight
    from mlxnb.core.constrain import Constraints
    from mlxnb.core.rows import SamplingParams

    cons = Constraints(tiny[1])
    masks = masks_mod.MaskFiller(cons, threads=3)  # 12 rows: 4 per thread
    kinds = [dict(json_schema=PERSON), dict(regex=REGEX), dict(choices=CHOICES),
             dict(grammar=LARK)]
    rows = [SimpleNamespace(params=SamplingParams(**k), matcher=None) for k in kinds * 3]
    for r in rows:
        masks.attach(r)
    ms = [r.matcher for r in rows]
    # rows take the lanes in turn; each lane compiles each constraint on its own, so
    # no two fill threads wait on one shared lexer
    assert [r.lane for r in rows] == [0, 1, 2] * 4
    assert len({id(cons._template(rows[0].params, lane)) for lane in range(3)}) == 3
    rows.insert(5, SimpleNamespace(params=SamplingParams(), matcher=None))  # a free row
    for i, r in enumerate(rows):
        r.id = i
    by_id = {r.id: r for r in rows}
    V = cons.lltokenizer().vocab_size
    constrained = [i for i in range(len(rows)) if i != 5]

    # the same constraints compiled apart, fed the same tokens here, one by one
    refs = {i: cons.compile(rows[i].params, "reference") for i in constrained}

    def step(ids, toks):
        masks.start(InFlight(ids, mx.array(toks)), by_id, rows)
        logits = masks.apply(mx.zeros((len(rows), V)))
        allowed = np.isfinite(np.array(logits))
        alone = lln.allocate_token_bitmask(len(constrained), V)
        for j, i in enumerate(constrained):
            if i in ids:
                refs[i].consume_token(toks[ids.index(i)])
            assert not ms[j].is_error() and not refs[i].is_error()
            lln.fill_next_token_bitmask(refs[i], alone, j)
        alone = np.unpackbits(alone.view(np.uint8), axis=1, bitorder="little")[:, :V] == 1
        np.testing.assert_array_equal(allowed[constrained], alone)
        assert allowed[5].all()  # the free row is not masked
        return allowed

    # The step in flight holds the last 8 constrained rows only (the first four
    # joined after it launched): the fill threads feed those, then fill all masks.
    fed = [i for i in constrained][4:]
    allowed = step(fed, list(b'{Ay({Bm('))
    assert np.flatnonzero(allowed[0]).tolist() == [ord("{")]  # a JSON object starts with {
    assert (allowed[4] != allowed[0]).any()  # row 4 read '{' first
    # A step in flight that holds exactly this batch: every row's token at its place.
    toks = [int(np.flatnonzero(allowed[i])[0]) if i != 5 else 7 for i in range(len(rows))]
    before = allowed
    allowed = step(list(range(len(rows))), toks)
    assert (allowed[0] != before[0]).any()  # row 0 read its '{'
    assert masks._plans  # (that step took the path for an unchanged batch)
    masks.close()


def test_a_remote_engine_refuses_constraints_instead_of_dropping_them(arun):
    import httpx

    from mlxnb.remote.engine import RemoteEngine

    async def main():
        eng = RemoteEngine("http://test:8000", _transport=httpx.MockTransport(
            lambda req: httpx.Response(404)))
        try:
            for kw in (dict(json_schema=PERSON), dict(regex=REGEX), dict(choices=CHOICES)):
                with pytest.raises(ValueError, match="remote server"):
                    eng.submit("x", **kw)
            return len(eng.rows)
        finally:
            await eng.aclose()

    assert arun(main) == 0
