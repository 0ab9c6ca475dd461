"""GenerationWidget against a fake engine that follows the engine contract (no model).

The fake uses the real `Row` / `StepRecord` types and emits the same listener events
on its loop: "submit", then per step "finish" (for rows ending) and "step".
"""

import asyncio
import html
import json
import re
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest

from mlxnb.core.rows import DECODE, DONE, PREFILL, Row, SamplingParams, StepRecord
from mlxnb.notebook import rowwire, textcap
from mlxnb.notebook.widget import MAX_STEP_POINTS, GenerationWidget

ROOT = Path(__file__).resolve().parent.parent


class FakeEngine:
    """Continuous batching in miniature: admit, chunked prefill, one token per step."""

    def __init__(self, max_batch=8, kv_budget=1 << 20, step_s=0.001, chunk=16,
                 bytes_per_tok=64):
        self.model_name, self.kv_budget, self.max_batch = "fake-model", kv_budget, max_batch
        self.loop = asyncio.get_running_loop()
        self.rows, self.steps, self._listeners = [], [], []
        self.step_s, self.chunk, self.bpt = step_s, chunk, bytes_per_tok
        self._active, self._queue, self._cancels = [], [], set()
        self._task = None
        self._t0 = self.loop.time()

    def clock(self):
        return self.loop.time() - self._t0

    running = property(lambda self: len(self._active))
    queued = property(lambda self: len(self._queue))

    def add_listener(self, fn):
        self._listeners.append(fn)

    def remove_listener(self, fn):
        self._listeners.remove(fn)

    def _notify(self, kind, obj):
        for fn in list(self._listeners):
            fn(kind, obj)

    def submit(self, prompt, max_tokens=16, prompt_len=40):
        row = Row(len(self.rows), prompt, list(range(prompt_len)),
                  SamplingParams(max_tokens=max_tokens), future=self.loop.create_future(),
                  t0=time.perf_counter() - self.clock(), canceller=lambda: self.cancel)
        self.rows.append(row)
        self._queue.append(row)
        self._notify("submit", row)
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._serve())
        return row

    def cancel(self, rows):
        for r in rows:
            if r in self._queue:
                self._queue.remove(r)
                self._end(r, "cancelled")
            elif not r.done:
                self._cancels.add(r.id)

    def _end(self, row, reason):
        if row in self._active:
            self._active.remove(row)
        row._finish(reason)
        self._notify("finish", row)

    async def _serve(self):
        while self._active or self._queue:
            await asyncio.sleep(self.step_s)
            while self._queue and len(self._active) < self.max_batch:
                r = self._queue.pop(0)
                r.state, r.t_admit = PREFILL, self.clock()
                self._active.append(r)
            decoded = prefilled = 0
            batch, ended = [], []  # as the engine's records: rows decoding, rows ended
            for r in list(self._active):
                if r.id in self._cancels:
                    ended.append(r.id)
                    self._end(r, "cancelled")
                elif r.state == PREFILL:
                    n = min(self.chunk, r.prompt_tokens - r.prefill_done)
                    r.prefill_done += n
                    prefilled += n
                    if r.prefill_done >= r.prompt_tokens:
                        r.state, r.t_first = DECODE, self.clock()
                        r.tokens.append(0)
                        r.text += "T0 "
                else:
                    r.tokens.append(len(r.tokens))
                    r.text += f"t{len(r.tokens)} "
                    decoded += 1
                    batch.append(r.id)
                    if r.ntok >= r.params.max_tokens:
                        ended.append(r.id)
                        self._end(r, "length")
            row_kv = {r.id: (r.prefill_done + r.ntok) * self.bpt for r in self._active}
            rec = StepRecord(len(self.steps), self.clock(), self.step_s, decoded, prefilled,
                             sum(row_kv.values()), batch, prefill_bytes=row_kv,
                             tokens=decoded, ended=tuple(ended))
            self.steps.append(rec)
            self._notify("step", rec)

    async def wait(self):
        await asyncio.gather(*(r._future for r in self.rows))


def capture(w):
    """Record every comm message the widget sends (custom and state updates)."""
    msgs = []
    w.comm.publish_msg = lambda msg_type, data=None, metadata=None, buffers=None, **k: \
        msgs.append(data)
    return msgs


def customs(msgs):
    return [m["content"] for m in msgs if m and m.get("method") == "custom"]


def replay(rows, deltas):
    """The front end's delta rule (lib.js applyRowDelta), in Python."""
    state = {r["id"]: dict(r) for r in rows}
    for m in deltas:
        for d in m["rows"]:
            r = state.setdefault(d["id"], {"text": ""})
            for k, v in d.items():
                if k == "d":
                    r["text"] = r.get("text", "") + v
                else:
                    r[k] = v
    return state


async def settle(w, eng):
    await eng.wait()
    for _ in range(100):  # the flusher sends the final delta, writes traits, exits
        if w._flusher is None:
            break
        await asyncio.sleep(0.02)


def test_flush_batches_tokens_into_few_small_messages():
    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit(f"prompt {i}", max_tokens=100) for i in range(4)]
        w = GenerationWidget(eng, rows)
        msgs = capture(w)
        t0 = eng.clock()
        await settle(w, eng)
        return eng, rows, w, msgs, eng.clock() - t0

    eng, rows, w, msgs, dur = asyncio.run(main())
    deltas = customs(msgs)
    ntok = sum(r.ntok for r in rows)
    assert ntok == 400
    # ~15 Hz, never one message per token
    assert len(deltas) <= dur * 20 + 3, (len(deltas), dur)
    assert len(deltas) < ntok / 5
    assert [m["seq"] for m in deltas] == list(range(deltas[0]["seq"], deltas[0]["seq"] + len(deltas)))
    nbytes = sum(len(json.dumps(m)) for m in deltas)
    assert nbytes / ntok < 200, nbytes / ntok  # bytes per streamed token, all included
    # deltas alone rebuild every row exactly (the initial traits held the prompts)
    state = replay([], deltas)
    for r in rows:
        assert state[r.id]["text"] == r.text
        assert state[r.id]["state"] == "done" and state[r.id]["finish"] == "length"
        assert state[r.id]["ntok"] == 100
    # no message resends the whole text of a row
    for m in deltas:
        for d in m["rows"]:
            assert "text" not in d


def test_traits_complete_after_sync_now_and_at_the_end():
    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit(f"p{i}", max_tokens=60) for i in range(3)]
        w = GenerationWidget(eng, rows, title="run")
        msgs = capture(w)
        while rows[0].ntok < 10:
            await asyncio.sleep(0.005)
        w.sync_now()  # synchronous: the traits are whole when it returns
        mid = {r["id"]: r["text"] for r in w.rows}
        assert mid == {r.id: r.text for r in rows}
        assert w.seq == customs(msgs)[-1]["seq"]
        assert w.steps["s"] and w.steps["snap"]
        assert w.header["live"] is True and w.header["title"] == "run"
        await settle(w, eng)
        return eng, rows, w, msgs

    eng, rows, w, msgs = asyncio.run(main())
    assert [r["state"] for r in w.rows] == ["done"] * 3
    assert [r["text"] for r in w.rows] == [r.text for r in rows]
    assert all(r["finish"] == "length" and r["ntok"] == 60 for r in w.rows)
    assert all(r["t_done"] is not None and r["ttft"] is not None for r in w.rows)
    assert w.header["live"] is False
    assert w.seq == customs(msgs)[-1]["seq"]
    # the KV history belongs to this widget's rows only, with the engine's byte counts
    ids = {r.id for r in rows}
    assert all(set(s[2][0::2]) <= ids for s in w.steps["snap"])
    by_step = {rec.step: rec for rec in eng.steps}
    for s, total, flat in w.steps["snap"]:
        assert total == by_step[s].kv_bytes
        assert dict(zip(flat[0::2], flat[1::2])) == by_step[s].row_kv_bytes
    # the finished widget stops listening and its flush task is gone
    assert w._flusher is None and w._on_event not in eng._listeners
    # one state message per trait write, holding all four traits
    updates = [m for m in msgs if m and m.get("method") == "update"]
    assert updates and all({"rows", "seq"} <= set(u["state"]) for u in updates if "rows" in u["state"])


def test_new_view_rebuilds_from_traits_plus_later_deltas():
    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit(f"p{i}", max_tokens=80) for i in range(2)]
        w = GenerationWidget(eng, rows)
        msgs = capture(w)
        while rows[0].ntok < 20:
            await asyncio.sleep(0.005)
        w._on_front_msg(w, {"type": "sync"}, [])  # what a late view asks for
        snap = (list(w.rows), w.seq)
        n_before = len(msgs)
        await settle(w, eng)
        return rows, snap, msgs[n_before:]

    rows, (trait_rows, seq), later = asyncio.run(main())
    deltas = [m for m in customs(later) if m["seq"] > seq]
    assert deltas and deltas[0]["seq"] == seq + 1
    state = replay(trait_rows, deltas)
    assert [state[r.id]["text"] for r in rows] == [r.text for r in rows]


def test_stop_message_cancels_the_row():
    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit(f"p{i}", max_tokens=500) for i in range(3)]
        w = GenerationWidget(eng, rows)
        while rows[1].ntok < 3:
            await asyncio.sleep(0.005)
        w._handle_custom_msg({"type": "stop", "id": rows[1].id}, [])  # as from the view
        w._handle_custom_msg({"type": "stop", "id": 999}, [])  # unknown ids are ignored
        await asyncio.wait_for(asyncio.shield(rows[1]._future), 2)
        assert rows[1].finish_reason == "cancelled"
        assert not rows[0].done and not rows[2].done
        w._handle_custom_msg({"type": "stop_all"}, [])
        await asyncio.wait_for(settle(w, eng), 5)
        return rows, w

    rows, w = asyncio.run(main())
    assert [r.finish_reason for r in rows] == ["cancelled"] * 3
    assert [r["finish"] for r in w.rows] == ["cancelled"] * 3


def test_text_fallback():
    async def main():
        eng = FakeEngine(step_s=0.001)
        rows = [eng.submit("Write a haiku about the sea.\nPlease.", max_tokens=8),
                eng.submit("Name three primes", max_tokens=4)]
        w = GenerationWidget(eng, rows)
        live = w.summary_text()
        await settle(w, eng)
        return w, live

    w, live = asyncio.run(main())
    assert "[queued]" in live and "fake-model" in live
    data, _meta = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "results are in the output below" in data["text/plain"]
    text = w.summary_text()
    lines = text.splitlines()
    assert lines[0].startswith("mlxnb fake-model | 2 rows (2 done)")
    assert "KV" in lines[0]
    assert lines[1].startswith("[done:length]") and "8 tok" in lines[1]
    assert '"Write a haiku about the sea. Please."' in lines[1]  # one line, newline folded
    assert '-> "T0 t2 t3' in lines[1]
    assert "tok/s" in lines[1] and "ttft" in lines[1]
    assert max(len(s) for s in lines) <= 120


def test_dashboard_picks_up_new_rows_and_stays_bounded():
    async def main():
        eng = FakeEngine(step_s=0.001)
        w = GenerationWidget(eng, max_rows=5)
        msgs = capture(w)
        assert w.rows == [] and w.header["mode"] == "dashboard"
        first = [eng.submit(f"a{i}", max_tokens=5) for i in range(3)]
        await settle(w, eng)
        assert [r["id"] for r in w.rows] == [r.id for r in first]
        assert all(r["state"] == "done" for r in w.rows)
        later = [eng.submit(f"b{i}", max_tokens=5) for i in range(4)]  # a later "cell"
        await settle(w, eng)
        return eng, w, msgs, first + later

    eng, w, msgs, rows = asyncio.run(main())
    assert [r["id"] for r in w.rows] == [r.id for r in rows[-5:]]  # oldest done dropped
    sent_ids = {d["id"] for m in customs(msgs) for d in m["rows"]}
    assert sent_ids == {r.id for r in rows}
    assert w._on_event in eng._listeners  # a dashboard keeps listening
    w.close()
    assert w._on_event not in eng._listeners


def test_a_dashboard_prunes_as_rows_finish_as_its_view_does():
    """Rows submitted together are all kept while live; as they finish, the traits
    drop the oldest done ones, as the front end's pruneRows does on each delta."""
    async def main():
        eng = FakeEngine(step_s=0.001, max_batch=2)
        w = GenerationWidget(eng, max_rows=3)
        rows = [eng.submit(f"a{i}", max_tokens=5) for i in range(6)]
        await asyncio.sleep(0.005)
        live = len(w._rows)
        await settle(w, eng)
        later = GenerationWidget(eng, max_rows=3)  # made now: the newest rows
        running = [eng.submit(f"b{i}", max_tokens=50) for i in range(5)]
        fresh = GenerationWidget(eng, max_rows=3)  # made while rows run: all of them
        shown = {r.id for r in fresh._rows.values()}
        for r in running:
            r.cancel()
        await eng.wait()
        for x in (w, later, fresh):
            x.close()
        return rows, running, w, later, live, shown

    rows, running, w, later, live, shown = asyncio.run(main())
    assert live == 6
    assert [r["id"] for r in w.rows] == [r.id for r in rows[-3:]]
    assert [r["id"] for r in later.rows] == [r.id for r in rows[-3:]]
    assert {r.id for r in running} <= shown


def test_late_widget_backfills_and_history_is_bounded():
    async def main():
        eng = FakeEngine(step_s=0.0, max_batch=4)
        rows = [eng.submit(f"p{i}", max_tokens=1500) for i in range(4)]
        await eng.wait()
        w = GenerationWidget(eng, rows)  # made after the run: traits only, no task
        return eng, rows, w

    eng, rows, w = asyncio.run(main())
    assert len(eng.steps) > 1500
    assert w._flusher is None and w._on_event not in eng._listeners
    assert 0 < len(w.steps["s"]) <= MAX_STEP_POINTS
    assert len({len(w.steps[k]) for k in ("s", "t", "dt", "b", "pf", "kv", "tk")}) == 1
    assert w.steps["s"][-1] == eng.steps[-1].step
    assert 0 < len(w.steps["snap"]) <= MAX_STEP_POINTS
    assert len(json.dumps(w.steps)) < 400_000
    assert [r["text"] for r in w.rows] == [r.text for r in rows]


def test_rewritten_text_is_replaced_not_appended():
    async def main():
        eng = FakeEngine(step_s=0.002)
        row = eng.submit("p", max_tokens=30)
        w = GenerationWidget(eng, [row])
        msgs = capture(w)
        while row.ntok < 5:
            await asyncio.sleep(0.005)
        w._flush()
        row.text = "rewritten "  # e.g. a held-back stop string released differently
        await settle(w, eng)
        return row, msgs

    row, msgs = asyncio.run(main())
    ds = [d for m in customs(msgs) for d in m["rows"]]
    assert any(d.get("text", "").startswith("rewritten") for d in ds)
    assert replay([], customs(msgs))[row.id]["text"] == row.text


def _finished(n, text_of):
    """`n` rows run to the end on the fake engine, then given `text_of(i)` as their text."""
    async def main():
        eng = FakeEngine(step_s=0.0, max_batch=n, chunk=64)
        rows = [eng.submit(f"p{i}", max_tokens=1) for i in range(n)]
        await eng.wait()
        for i, r in enumerate(rows):
            r.text = text_of(i)
        return eng, rows
    return asyncio.run(main())


def test_saved_state_keeps_a_bounded_text_and_marks_the_rows_it_cut():
    """1,500 finished rows of 3,000 characters (4.5 M in all) and 100 short ones: the
    rows trait holds at most TEXT_BUDGET characters of text; each long row keeps the
    head of its text and says how much it left out; short rows and the rows themselves
    are whole."""
    def text_of(i):
        return f"row {i}: " + "lorem ipsum " * 5 if i % 16 == 0 else f"{i}:" + "abcdefghij" * 300

    eng, rows = _finished(1600, text_of)
    w = GenerationWidget(eng, rows)  # made after the run: the traits alone
    assert len(w.rows) == 1600
    assert sum(len(d["text"]) for d in w.rows) <= textcap.TEXT_BUDGET
    # what a saved notebook holds: the budget, and well under 1 KB a row besides
    assert len(json.dumps(w.rows)) < textcap.TEXT_BUDGET + 1000 * len(rows)
    kept = set()
    for d, r in zip(w.rows, rows):
        assert r.text == text_of(r.id)  # the row keeps all of its text
        if len(r.text) < 100:
            assert d == rowwire.full(r) and "cut" not in d
        else:
            assert r.text.startswith(d["text"]) and d["cut"] == len(r.text) - len(d["text"]) > 0
            kept.add(len(d["text"]))
    assert len(kept) == 1 and kept.pop() > 1000  # one share for every long row
    # a short run: every row whole, its dict as the row makes it
    eng, short = _finished(20, lambda i: f"answer {i} " * 40)
    w = GenerationWidget(eng, short)
    assert w.rows == [rowwire.full(r) for r in short]
    assert not any("cut" in d for d in w.rows)


def test_a_few_very_long_rows_are_cut_to_the_row_limit():
    eng, rows = _finished(3, lambda i: "x" * (textcap.ROW_TEXT_MAX + 10_000 * (i + 1)))
    w = GenerationWidget(eng, rows)
    assert [len(d["text"]) for d in w.rows] == [textcap.ROW_TEXT_MAX] * 3
    assert [d["cut"] for d in w.rows] == [10_000, 20_000, 30_000]


def test_running_rows_stay_whole_in_the_traits_and_are_cut_once_finished(monkeypatch):
    """Deltas append to the text a view holds, so a row still running is never cut:
    traits taken mid-run plus the later deltas rebuild every row exactly."""
    monkeypatch.setattr(textcap, "TEXT_BUDGET", 300)

    async def main():
        eng = FakeEngine(step_s=0.002, max_batch=2)
        rows = [eng.submit(f"p{i}", max_tokens=60) for i in range(4)]
        w = GenerationWidget(eng, rows)
        msgs = capture(w)
        while not rows[0].done:
            await asyncio.sleep(0.005)
        while rows[2].ntok < 5:
            await asyncio.sleep(0.005)
        w._on_front_msg(w, {"type": "sync"}, [])  # what a late view asks for
        snap = ([dict(d) for d in w.rows], w.seq)
        n_before = len(msgs)
        await settle(w, eng)
        return rows, w, snap, msgs[n_before:]

    rows, w, (mid, seq), later = asyncio.run(main())
    by_id = {d["id"]: d for d in mid}
    assert "cut" in by_id[rows[0].id]  # finished first: cut (60 tokens > the share)
    for r in rows[2:]:  # running then: whole, and the deltas continue from there
        assert "cut" not in by_id[r.id]
    deltas = [m for m in customs(later) if m["seq"] > seq]
    state = replay(mid, deltas)
    for r in rows[2:]:
        assert state[r.id]["text"] == r.text
    # at the end every row is finished: all of them share the budget
    assert sum(len(d["text"]) for d in w.rows) <= 300
    assert all(d["cut"] == len(r.text) - len(d["text"]) > 0 for d, r in zip(w.rows, rows))


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_lib_js_rebuilds_the_same_state_as_the_kernel(tmp_path):
    """Cross-check with the real front-end code: traits + deltas through lib.js."""
    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit(f"p{i}", max_tokens=50) for i in range(3)]
        w = GenerationWidget(eng, rows)
        traits = {"rows": w.rows, "steps": w.steps, "header": w.header, "seq": w.seq}
        msgs = capture(w)
        await settle(w, eng)
        return rows, w, traits, customs(msgs)

    rows, w, traits, deltas = asyncio.run(main())
    (tmp_path / "in.json").write_text(json.dumps({"traits": traits, "msgs": deltas}))
    script = f"""
import {{ stateFromTraits, applyMessage }} from {json.dumps(str(ROOT / 'js' / 'lib.js'))};
import {{ readFileSync }} from "node:fs";
const {{ traits, msgs }} = JSON.parse(readFileSync(process.argv[2], "utf8"));
const st = stateFromTraits(traits);
let gaps = 0;
for (const m of msgs) if (applyMessage(st, m).gap) gaps++;
console.log(JSON.stringify({{ gaps, seq: st.seq, rows: [...st.rows.values()],
  n: st.hist.s.length, last: st.hist.s.at(-1) }}));
"""
    (tmp_path / "t.mjs").write_text(script)
    out = subprocess.run(["node", str(tmp_path / "t.mjs"), str(tmp_path / "in.json")],
                         capture_output=True, text=True, timeout=30, check=True)
    got = json.loads(out.stdout)
    assert got["gaps"] == 0 and got["seq"] == w.seq
    assert [r["text"] for r in got["rows"]] == [r.text for r in rows]
    assert [r["state"] for r in got["rows"]] == ["done"] * 3
    assert got["last"] == w.steps["s"][-1]
    # the view's rows carry the same fields as the final traits
    for mine, final in zip(got["rows"], w.rows):
        assert {k: mine.get(k) for k in final} == final


def test_real_engine_streams_into_the_widget():
    """The real Engine on the tiny random model: deltas and traits match the rows."""
    tiny = pytest.importorskip("mlxnb.models.tiny")
    from mlxnb import Engine

    model = tiny.tiny_model()

    async def main():
        eng = Engine(model, max_batch=8, kv_budget=None)
        try:
            run = eng.generate([f"row {i} says" for i in range(4)], max_tokens=40)
            run.widget = w = GenerationWidget(eng, run.rows, title="t")
            msgs = capture(w)
            dash = GenerationWidget(eng)
            late = eng.generate(["a late row"], max_tokens=10)  # joins the running batch
            await run  # calls w.sync_now() before returning
            traits = list(w.rows)
            await late
            await settle(w, eng)
            await settle(dash, eng)
            return run, late, w, dash, msgs, traits
        finally:
            await eng.aclose()

    run, late, w, dash, msgs, traits = asyncio.run(main())
    assert [r["text"] for r in traits] == run.texts
    assert all(r["state"] == "done" for r in traits)
    state = replay([], customs(msgs))
    assert [state[r.id]["text"] for r in run.rows] == run.texts
    assert {r["id"] for r in dash.rows} >= {r.id for r in run.rows + late.rows}
    assert w.steps["s"] and any(s[2] for s in w.steps["snap"])
    assert w.header["model"] and "tok" in w.summary_text()


def test_results_output_follows_the_widget_and_is_kept_current(monkeypatch):
    """Displayed, a widget is two outputs: the widget view, then its results (text/plain
    + text/html) under a display id, updated when rows finish; unfinished rows say so."""
    import IPython.core.display_functions as df

    published = []
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setattr(InteractiveShell, "initialized", classmethod(lambda cls: True))
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setattr(df, "publish_display_data", lambda data, metadata=None, **k:
                        published.append((data, k.get("transient") or {}, k.get("update"))))

    async def main():
        eng = FakeEngine(step_s=0.002)
        rows = [eng.submit("<b>bold</b> & \"quoted\"", max_tokens=6),
                eng.submit("second", max_tokens=40)]
        w = GenerationWidget(eng, rows, title="a")
        w._ipython_display_()
        first = list(published)
        await settle(w, eng)
        return w, rows, first

    w, rows, first = asyncio.run(main())
    (view, t0, _), (res, t1, upd) = first
    assert "application/vnd.jupyter.widget-view+json" in view and not t0
    assert t1 == {"display_id": w.display_id} and not upd
    assert "2 rows unfinished as of" in res["text/plain"]
    assert res["text/html"].count('data-state="unfinished"') == 2
    assert "<b>bold" not in res["text/html"]  # escaped
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &quot;quoted&quot;" in res["text/html"]
    updates = [(d, t) for d, t, u in published[2:] if u]
    assert updates and all(t == {"display_id": w.display_id} for _, t in updates)
    last = updates[-1][0]
    assert "2/2 rows done" in last["text/plain"] and "unfinished" not in last["text/plain"]
    for r in rows:
        assert r.text and html.escape(r.text) in last["text/html"]
        assert r.text.splitlines()[0] in last["text/plain"]
    assert last["text/html"].count('data-state="done"') == 2
    assert "done: length" in last["text/plain"]


def test_results_html_is_bounded_and_escaped():
    from mlxnb.notebook import results

    class R:  # the Row fields results.py reads
        def __init__(self, i, text):
            self.id, self.prompt, self.text, self.done, self.state = i, f"p{i}", text, True, "done"
            self.finish_reason, self.ntok, self.tok_s, self.ttft_s = "length", 5, 10.0, 0.1
            self.error, self.prompt_tokens, self.prefill_done = None, 3, 3
            self.t_admit, self.t_done = 0.0, 1.0
            self.params = SamplingParams()

    rows = [R(i, "<script>x</script>" + "y" * 50_000) for i in range(100)]
    b = results.bundle(rows, "m", "run")
    assert len(b["text/html"]) < 300_000 and "<script>" not in b["text/html"]
    assert "more characters: see run.texts" in b["text/plain"]
    assert "100/100 rows done" in b["text/html"] and "tok/s over the run" in b["text/plain"]
    # the total holds however many rows (a cell's most: 1024), each still a line
    many = [R(i, "z" * 2_000) for i in range(1024)]
    b = results.bundle(many, "m", "run")
    assert b["text/plain"].count("z") <= results.TOTAL_CHARS
    assert b["text/plain"].count("more characters: see run.texts") == 1024
    # a grid's rows say the settings that tell them apart (not those they share)
    grid = [R(i, "t") for i in range(4)]
    for r, (temp, k) in zip(grid, [(0.5, 0), (0.5, 1), (0.9, 0), (0.9, 1)]):
        r.tag = {"prompt_index": 0, "temp": temp, "seed": 7, "sample": k}
    plain = results.bundle(grid, "m", "run")["text/plain"]
    assert "[3] done: length \u00b7 temp=0.9 sample=0 \u00b7 5 tok" in plain
    assert "seed=" not in plain and "prompt_index" not in plain
    plain_row = R(4, "t")  # a dashboard's row from a cell without a sweep
    plain = results.bundle(grid + [plain_row], "m", "dashboard")["text/plain"]
    assert "[5] done: length \u00b7 5 tok" in plain and "None" not in plain
    # errors count within the total too
    failed = [R(i, "w" * 500) for i in range(1024)]
    for r in failed:
        r.finish_reason, r.error = "error", "x" * 1000
    b = results.bundle(failed, "m", "run")
    assert b["text/plain"].count("w") + b["text/plain"].count("x") <= results.TOTAL_CHARS
    # an errored row keeps the text it generated, under its error
    bad = R(0, "partial text")
    bad.finish_reason, bad.error = "error", "logits processor failed: boom"
    b = results.bundle([bad], "m", "run")
    for form in ("text/plain", "text/html"):
        assert "error: logits processor failed: boom" in b[form] and "partial text" in b[form]


def test_terminal_ipython_gets_one_text_snapshot(monkeypatch):
    """Without a kernel every display and update is printed: the widget shows as one
    text snapshot and never publishes updates."""
    import IPython
    import IPython.core.display_functions as df
    from IPython.core.interactiveshell import InteractiveShell

    published = []
    monkeypatch.setattr(InteractiveShell, "initialized", classmethod(lambda cls: True))
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace())
    monkeypatch.setattr(df, "publish_display_data", lambda data, metadata=None, **k:
                        published.append(data))

    async def main():
        eng = FakeEngine(step_s=0.002)
        w = GenerationWidget(eng, [eng.submit("hi", max_tokens=5)])
        w._ipython_display_()
        await settle(w, eng)
        return w

    w = asyncio.run(main())
    assert len(published) == 1 and list(published[0]) == ["text/plain"]
    assert published[0]["text/plain"].startswith("mlxnb fake-model")


def _json_row(rid, text, finish):
    row = Row(rid, f"p{rid}", [1, 2], SamplingParams(max_tokens=8, json_schema={"type": "object"}),
              future=None, t0=time.perf_counter())
    row.text, row.tokens, row.state, row.finish_reason = text, [1] * 8, DONE, finish
    row.t_admit, row.t_done = 0.0, 1.0
    return row


def test_saved_results_say_the_constraint_and_whether_each_row_meets_it():
    """The results output (what a notebook saved without widget state shows) names a
    structured row's constraint, says valid or invalid, and why invalid; the heading
    names the run by its -o name without reading "run run"."""
    from mlxnb.notebook import results

    good, cut = _json_row(0, '{"name": "Ada"}', "stop"), _json_row(1, '{"name": "Ad', "length")
    b = results.bundle([good, cut], "m", "run")
    plain = b["text/plain"]
    lines = [ln for ln in plain.splitlines() if ln.startswith("[")]
    assert "json: valid" in lines[0], lines
    assert "json: invalid: not valid JSON" in lines[1] and "raise --max-tokens" in lines[1], lines
    assert 'data-valid="1"' in b["text/html"] and 'data-valid="0"' in b["text/html"]
    assert "json: invalid" in b["text/html"]
    assert "run run" not in plain and "-o run" in plain.splitlines()[0]
    free = Row(2, "p", [1], SamplingParams(), future=None, t0=time.perf_counter())
    assert results.verdict(free) == ""


def test_widget_prompt_keeps_the_tail_of_a_long_prompt():
    """Rows of one long template differ near the end: the widget gets head and tail."""
    from mlxnb.notebook.rowwire import PROMPT_CHARS, prompt_text as _prompt

    p = "Extract the person's name. " * 20 + "Sentence: Grace Hopper wrote a compiler."
    got = _prompt(p)
    assert len(got) <= PROMPT_CHARS and got.endswith("Grace Hopper wrote a compiler.")
    assert got.startswith("Extract the person's name.") and "\u2026" in got
    assert _prompt("short") == "short"


def test_a_second_run_counts_its_steps_from_one():
    """header.step0: the engine step before the run's first, so the front end labels a
    second run's steps 1, 2, ... (a dashboard keeps the engine's numbers)."""
    async def main():
        eng = FakeEngine(step_s=0.001)
        first = [eng.submit("a", max_tokens=5)]
        w1 = GenerationWidget(eng, first)
        await settle(w1, eng)
        n = len(eng.steps)
        second = [eng.submit("b", max_tokens=5)]
        w2 = GenerationWidget(eng, second)
        await settle(w2, eng)
        return w1, w2, n

    w1, w2, n = asyncio.run(main())
    assert w1.header["step0"] == -1 and w1.steps["s"][0] == 0
    assert n > 3 and w2.header["step0"] == n - 1, (n, w2.header["step0"])
    assert w2.steps["s"][0] - w2.header["step0"] == 1


def test_a_step_in_which_rows_ended_is_a_point_of_its_own():
    # 100 steps into 32 points: buckets of 4, but steps 6 and 50 end rows, and the
    # inspector opens a point's last step, so each closes its bucket
    from mlxnb.notebook import stepchart

    recs = [StepRecord(i, 0.01 * i, 0.001 * (1 + i % 3), 2, 0, 64 * i, (0, 1), 32,
                       tokens=2, ended=(7,) if i in (6, 50) else ())
            for i in range(100)]
    pts = stepchart.points(recs, 32)
    assert {6, 50, 99} <= set(pts["s"]) and pts["s"] == sorted(pts["s"])
    assert len(pts["s"]) <= 32 + 2
    assert len({len(pts[k]) for k in stepchart.STEP_KEYS}) == 1
    # each point's dt is the mean of the steps it holds: none lost, none twice
    bounds = [-1] + pts["s"]
    for lo, hi, dt in zip(bounds, bounds[1:], pts["dt"]):
        grp = recs[lo + 1:hi + 1]
        assert dt == round(1000 * sum(r.dt_s for r in grp) / len(grp), 2)
    # without endings, buckets of 4 as before
    plain = stepchart.points([StepRecord(i, 0, 0.001, 2, 0, 0) for i in range(100)], 32)
    assert plain["s"] == list(range(3, 100, 4))


def test_a_run_widget_ends_at_the_step_its_last_row_ended_in():
    # Row b runs on after the run's rows end; the run's widget flushes twice a second,
    # so b's steps reach it before the flush that sees its rows done
    async def main():
        eng = FakeEngine(step_s=0.001, max_batch=4)
        run = [eng.submit(f"a{i}", max_tokens=5 + i, prompt_len=8) for i in range(2)]
        eng.submit("b", max_tokens=300, prompt_len=8)
        w = GenerationWidget(eng, run, flush_hz=2)
        capture(w)
        await eng.wait()
        await settle(w, eng)
        return eng, run, w

    eng, run, w = asyncio.run(main())
    last = max(s.step for s in eng.steps if run[1].id in s.ended)
    assert eng.steps[-1].step > last + 50
    assert w.steps["s"][-1] == last


def test_saved_results_keep_showing_rows_whose_handles_are_gone(tiny, arun):
    """A widget holds finished rows weakly; once the user's handles are gone, its saved
    results still show them as they ended, and go on updating for the other rows."""
    import gc

    from mlxnb import Engine
    from mlxnb.notebook import results
    from mlxnb.notebook.rowtable import RowTable

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        try:
            rows = [eng.submit("a", max_tokens=4, tag={"x": 1}),
                    eng.submit("b", max_tokens=4, tag={"x": 2}, regex="[ab]+")]
            for r in rows:
                await r
            table = RowTable(rows, keep=results.kept_tag, show=results.Ended)
            table.full(rowwire.full)  # recorded: from now on held weakly
            before = results.bundle(table.shown(), "m", "run")
            del rows, r
            gc.collect()
            assert table.values() == []  # gone ...
            now = results.bundle(table.shown(), "m", "run")  # ... and shown as they ended
            # (rates and times: as the record rounds them, so the last digit may move)
            figures = lambda b: re.sub(r"[0-9]+", "#", b["text/plain"])  # noqa: E731
            assert figures(now) == figures(before)
            assert now["text/html"].count('data-state="done"') == 2
            assert now["text/html"].count('data-valid="1"') == 1
            assert "regex: valid" in before["text/plain"]
            later = eng.submit("c", max_tokens=2)
            table[later.id] = later
            await later
            after = results.bundle(table.shown(), "m", "run")["text/plain"]
            assert "3/3 rows done" in after and "prompt: a" in after
        finally:
            await eng.aclose()

    arun(main)
