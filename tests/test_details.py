"""The widget's detail views' data (details.py): asked for by the front end when a
view opens, answered once; checked against the rows and steps themselves."""

import asyncio
import math

import pytest

from mlxnb import Engine
from mlxnb.notebook import details
from mlxnb.notebook.widget import GenerationWidget
from test_widget import FakeEngine, capture, customs, settle


def _ask(w, msg):
    msgs = capture(w)
    w._on_front_msg(w, msg, [])
    return customs(msgs)


def test_row_detail_gives_each_tokens_probability_and_alternatives(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        run = eng.generate(["hello there", "abc"], max_tokens=12, chat=False,
                           temperature=0.8, top_p=0.9, logprobs=3, seed=1)
        w = GenerationWidget(eng, run.rows)
        await run
        free = eng.generate(["no logprobs here"], max_tokens=5, chat=False)
        await free
        w2 = GenerationWidget(eng, free.rows)
        out = _ask(w, {"type": "row_detail", "id": run.rows[0].id})
        out2 = _ask(w2, {"type": "row_detail", "id": free.rows[0].id})
        kept = dict(w.details)
        await eng.aclose()
        return run.rows[0], out, out2, kept, eng

    row, [d], [d2], kept, eng = arun(main)
    assert d["type"] == "row_detail" and d["id"] == row.id
    tv = d["tokens"]
    assert tv["probs"] and len(tv["items"]) == row.ntok == 12
    for it, lp, tid in zip(tv["items"], row.logprobs, row.tokens):
        assert it["id"] == tid
        assert math.isclose(it["p"], math.exp(lp["logprob"]), abs_tol=1e-5)
        assert 1 <= len(it["top"]) <= 3
        assert [a["id"] for a in it["top"]] == [t for t, _ in lp["top"]][:len(it["top"])]
        assert isinstance(it["s"], str)
    assert "".join(it["s"] for it in tv["items"]) == row.text  # byte tokens: exact
    assert tv["sampling"]["temperature"] == 0.8 and tv["sampling"]["top_p"] == 0.9
    assert [p["phase"] for p in d["trace"]][0] == "queued" and d["trace"][-1]["phase"] == "finish"
    assert kept == {str(row.id): d}  # a finished row's detail is kept in the traits
    # a row that did not ask for logprobs: its tokens, and how to see probabilities
    assert not d2["tokens"]["probs"] and "p" not in d2["tokens"]["items"][0]
    assert "--logprobs" in d2["why"]


def test_step_detail_matches_the_step_record(tiny, arun):
    async def main():
        eng = Engine(tiny, kv_budget="64MB", max_batch=4, warmup=False)
        run = eng.generate(["hello there", "abc", "a third prompt"], max_tokens=6, chat=False)
        w = GenerationWidget(eng, run.rows)
        await run
        ended = next(s for s in eng.steps if s.ended)
        pre = next(s for s in eng.steps if s.prefill_rows)
        a = _ask(w, {"type": "step_detail", "step": ended.step})
        b = _ask(w, {"type": "step_detail", "step": pre.step})
        c = _ask(w, {"type": "step_detail", "step": 10 ** 9})
        bad = _ask(w, {"type": "step_detail", "step": "1"}) + _ask(w, {"type": "row_detail", "id": [1]})
        kept = dict(w.step_details)
        await eng.aclose()
        return ended, pre, a, b, c, bad, run, kept

    ended, pre, [a], [b], [c], bad, run, kept = arun(main)
    # the steps inspected are kept in the traits (a saved notebook has them), not a
    # step the engine never had
    assert kept == {str(ended.step): a, str(pre.step): b} or \
        (ended.step == pre.step and kept == {str(pre.step): b})
    assert a["step"] == ended.step and a["ended"] == list(ended.ended)
    assert a["batch_ids"] == list(ended.batch_ids) and a["batch_size"] == ended.batch_size
    assert a["finish"] == {str(i): "length" for i in ended.ended}
    assert math.isclose(a["ms"], 1000 * ended.dt_s, abs_tol=1e-3)
    assert math.isclose(sum(a["split"].values()), a["ms"], rel_tol=1e-3, abs_tol=0.01)
    assert a["kv_budget"] == 64 << 20 and a["kv_bytes"] == ended.kv_bytes
    assert b["prefill_rows"] == {str(k): v for k, v in pre.prefill_rows.items()}
    assert set(b["labels"]) >= set(b["prefill_rows"])
    assert c == {"type": "step_detail", "step": 10 ** 9, "missing": True}
    assert bad == []  # not a step number, not a row id: no answer, no error


def test_kept_details_are_bounded():
    d = {"type": "row_detail", "tokens": {"items": [{"i": i} for i in range(5000)], "more": 0}}
    kept = {}
    for rid in range(20):
        kept = details.keep(kept, rid, d)
    assert list(kept) == [str(i) for i in range(12, 20)]
    assert len(kept["19"]["tokens"]["items"]) == details.KEEP_TOKENS
    assert kept["19"]["tokens"]["more"] == 5000 - details.KEEP_TOKENS
    assert len(d["tokens"]["items"]) == 5000  # the answer sent is not cut


def test_row_detail_without_a_tokenizer_still_answers():
    async def main():
        eng = FakeEngine(step_s=0.001)
        rows = [eng.submit("p", max_tokens=4)]
        w = GenerationWidget(eng, rows)
        await settle(w, eng)
        return _ask(w, {"type": "row_detail", "id": rows[0].id}), rows[0]

    [d], row = asyncio.run(main())
    assert [it["id"] for it in d["tokens"]["items"]] == row.tokens
    assert "s" not in d["tokens"]["items"][0]


def test_a_running_rows_view_asks_only_for_the_tokens_it_lacks():
    """While a row runs its open view asks again with `from` (the tokens it holds): the
    answer carries only the rest, numbered on; a finished row is kept whole."""
    async def main():
        eng = FakeEngine(step_s=0.001)
        rows = [eng.submit("p", max_tokens=12)]
        w = GenerationWidget(eng, rows)
        await settle(w, eng)
        part = _ask(w, {"type": "row_detail", "id": rows[0].id, "from": 5})
        bad = _ask(w, {"type": "row_detail", "id": rows[0].id, "from": "x"})
        return part, bad, dict(w.details), rows[0]

    [part], [bad], kept, row = asyncio.run(main())
    tv = part["tokens"]
    assert tv["start"] == 5 and [it["i"] for it in tv["items"]] == list(range(5, row.ntok))
    assert [it["id"] for it in tv["items"]] == row.tokens[5:]
    assert bad["tokens"]["start"] == 0 and len(bad["tokens"]["items"]) == row.ntok
    assert len(kept[str(row.id)]["tokens"]["items"]) == row.ntok  # kept whole


@pytest.mark.parametrize("speculating", [0, 3])
def test_a_structured_rows_tokens_say_how_many_tokens_its_constraint_allowed(tiny, arun,
                                                                            speculating):
    """Each decoded token of a constrained row with logprobs carries the number of
    tokens its mask allowed at that step: checked by replaying the row's tokens on a
    fresh copy of its constraint, for rows of different constraints sharing a batch
    with a free row (so batch positions and the mask stacking both matter), and with
    rows that speculate (so some of those steps are verification steps)."""
    import llguidance.numpy as lln
    import numpy as np

    kinds = [dict(regex="[a-c]{3}[0-9]{5}"), dict(), dict(regex="[a-z]{2}[xy]{6}"),
             dict(choices=["alpha", "beta", "gamma delta"])]

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        # rows that speculate make verification steps, which the others join
        spec = [eng.submit("abcabc abcabc abcabc " * 4, chat=False, max_tokens=400,
                           speculate="lookup", num_draft=4) for _ in range(speculating)]
        while spec and not any(r.draft_proposed for r in spec):
            await asyncio.sleep(0.001)
        rows = [eng.submit(f"prompt {i}", chat=False, max_tokens=12, logprobs=2,
                           temperature=0.9, seed=i, **kw) for i, kw in enumerate(kinds)]
        for r in rows:
            await r
        eng.cancel(spec)
        for r in spec:
            await r
        out = [(r.params, list(r.tokens), list(r.logprobs)) for r in rows]
        cons = eng.constraints
        await eng.aclose()
        return out, cons, sum(r.draft_proposed for r in spec)

    out, cons, drafted = arun(main)
    assert drafted or not speculating
    checked = 0
    for (params, toks, lps), kw in zip(out, kinds):
        if not kw:
            assert all("allowed" not in lp for lp in lps)
            continue
        m = cons.compile(params)
        buf = cons.bitmask(1)
        for i, (tok, lp) in enumerate(zip(toks, lps)):
            lln.fill_next_token_bitmask(m, buf, 0)
            want = int(np.bitwise_count(buf.view(np.uint32)).sum())
            if i > 0:  # the first token comes from the prompt's prefill
                assert lp.get("allowed") == want, (kw, i, lp, want)
                checked += 1
            m.consume_token(tok)
    assert checked >= 10


def test_kept_steps_are_bounded_and_latest_last():
    kept = {}
    for n in range(details.KEEP_STEPS + 10):
        kept = details.keep_step(kept, {"type": "step_detail", "step": n, "batch_ids": [n]})
    assert len(kept) == details.KEEP_STEPS
    assert list(kept)[0] == "10" and list(kept)[-1] == str(details.KEEP_STEPS + 9)
    again = details.keep_step(kept, {"type": "step_detail", "step": 20, "batch_ids": [20]})
    assert list(again)[-1] == "20" and len(again) == details.KEEP_STEPS
    assert details.keep_step(again, {"type": "step_detail", "step": 5, "missing": True}) is again


def test_the_inspectors_answer_for_finished_rows_nobody_holds_any_more():
    import gc

    async def main():
        eng = FakeEngine(step_s=0.001)
        rows = [eng.submit(f"p{i}", max_tokens=5) for i in range(2)]
        w = GenerationWidget(eng, rows)
        msgs = capture(w)
        await settle(w, eng)
        ended = [s.step for s in eng.steps if s.ended][-1]
        eng.rows.clear()  # the user's handles go (a `run` re-bound)
        rows.clear()
        gc.collect()
        assert not w._rows.values() and len(w._rows) == 2
        w._on_front_msg(w, {"type": "step_detail", "step": ended}, [])
        w._on_front_msg(w, {"type": "row_detail", "id": 0}, [])
        w.close()
        return [m for m in customs(msgs) if m["type"] in ("step_detail", "row_detail")]

    step, row = asyncio.run(main())
    assert step["type"] == "step_detail" and step["labels"] == {"0": "p0", "1": "p1"}
    assert step["finish"] == {"0": "length", "1": "length"}
    assert row == {"type": "row_detail", "id": 0, "gone": True, "trace": []}


def test_a_token_view_spells_each_tokens_share_of_the_text(tiny, arun):
    """Byte-level pieces of one character show on the token completing it, so the
    pieces joined are the row's text (and the text from any start on)."""
    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        row = eng.submit("x", chat=False, max_tokens=40, choices=["héllo 😀 שלום"])
        await row
        views = [details.token_view(row, eng.tokenizer, start) for start in (0, 7)]
        await eng.aclose()
        return row, views

    row, (whole, tail) = arun(main)
    assert row.text == "héllo 😀 שלום" and len(row.tokens) > len(row.text)
    assert "".join(it["s"] for it in whole["items"]) == row.text
    assert [it["s"] for it in tail["items"]] == [it["s"] for it in whole["items"]][7:]
    assert "" in [it["s"] for it in whole["items"]]  # a byte that completes nothing


def test_the_rest_of_a_token_view_from_any_token_is_the_whole_views_rest(tiny, arun):
    # what a live view asks for as a row grows: it starts inside characters too
    texts = ["a😀😀😀b", "👨\u200d👩\u200d👧 ok", "中文字符测试"]

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        rows = [eng.submit("x", chat=False, max_tokens=60, choices=[t])
                for t in texts]
        await asyncio.gather(*rows)
        views = [[details.token_view(r, eng.tokenizer, s) for s in range(len(r.tokens) + 1)]
                 for r in rows]
        await eng.aclose()
        return rows, views

    rows, views = arun(main)
    for text, row, per_start in zip(texts, rows, views):
        assert row.text == text
        whole = [it["s"] for it in per_start[0]["items"]]
        assert "".join(whole) == text
        for s, v in enumerate(per_start):
            assert [it["s"] for it in v["items"]] == whole[s:], (text, s)


@pytest.mark.parametrize("raw", [b"ab\x80cd", "ab\ufffdcd".encode(), b"\x80a"])
def test_the_rest_of_a_token_view_keeps_a_replacement_character_before_it(raw):
    from mlxnb.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    toks = list(raw)  # byte b is token b
    whole = details._pieces(tok, toks, 0)
    assert "".join(whole[i] for i in sorted(whole)) == raw.decode("utf-8", "replace")
    for s in range(len(toks)):
        assert details._pieces(tok, toks, s) == {i: p for i, p in whole.items() if i >= s}


def test_a_token_view_shows_no_number_for_a_logprob_without_one(tiny, arun):
    import json

    def nan(tokens, logits):
        return logits * float("nan")

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        row = eng.submit("x", chat=False, max_tokens=3, logprobs=3,
                         logits_processors=[nan])
        await row
        view = details.token_view(row, eng.tokenizer)
        await eng.aclose()
        return row, view

    row, view = arun(main)
    assert row.logprobs and all(not (lp["logprob"] == lp["logprob"]) for lp in row.logprobs)
    assert [it["p"] for it in view["items"]] == [None] * len(row.tokens)
    assert all(a["p"] is None for it in view["items"] for a in it["top"])
    json.dumps(view, allow_nan=False)  # what the kernel's strict JSON sends


def test_a_servers_row_shows_its_tokens_from_its_logprobs():
    from types import SimpleNamespace

    from mlxnb.core.rows import SamplingParams

    lps = [{"token": "H", "logprob": -0.5, "top": [("H", -0.5), ("Y", -1.2)]},
           {"token": "i", "logprob": -0.1, "top": [("i", -0.1)]}]
    row = SimpleNamespace(tokens=[], logprobs=lps, params=SamplingParams(logprobs=2))
    view = details.token_view(row, None)
    assert [(it["i"], it["id"], it["s"]) for it in view["items"]] == [(0, None, "H"),
                                                                     (1, None, "i")]
    assert view["items"][0]["top"] == [{"id": None, "p": 0.60653, "s": "H"},
                                       {"id": None, "p": 0.30119, "s": "Y"}]
    assert view["probs"] and view["more"] == 0
    assert [it["s"] for it in details.token_view(row, None, 1)["items"]] == ["i"]
