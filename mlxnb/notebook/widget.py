"""The live generation widget: rows streaming, KV memory, step timing, row timeline.

Traffic design (measured with `python -m bench widget-traffic`): reassigning traits per
token resends whole lists, so live progress travels as small custom messages
(`widget.send`) batched at ~15 Hz by one flush task that runs only while rows are live.
Custom messages never reach views created later, so the full state is also written
into synced traits -- when rows finish (debounced) and in `sync_now()` -- and every
message carries a sequence number: a view that sees a gap asks for a resync. The
traits are also what a notebook saved with widget state keeps, so finished rows' text
in them is cut to a share of a budget (textcap.py).

Message protocol (kernel -> front end), one per flush::

    {"type": "delta", "seq": n,
     "rows": [{"id", and only what changed among: state, ntok, pf (prefill %), tok_s,
               ttft, finish, error, t_admit, t_first, t_done, and for a constrained
               row con (json | regex | choice | grammar) and parse (pending | ok |
               why its output is invalid); prompt, prompt_tokens,
               t_submit on a row's first appearance; "d": text appended since the
               last message, or "text": the whole text when it was rewritten}],
     "steps": {"s", "t", "dt", "b", "pf", "kv", "tk": [...], "snap": [[step, kv, [id, bytes, ...]]]},
     "header": {changed header fields}}

Front end -> kernel: {"type": "stop", "id": n}, {"type": "stop_all"}, {"type": "sync"}
(answered with the full state in the traits and {"type": "synced", "seq": n}); and
when a detail view opens, {"type": "row_detail", "id": n, "from": tokens held} or
{"type": "step_detail", "step": s}, answered with one message each (details.py). The rows
and steps opened last are also kept in the `details` and `step_details` traits, so a
notebook saved with widget state has them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import time
import uuid
import weakref
from collections import deque

import anywidget
import traitlets as t

from .. import _aio
from . import details as _details
from . import stepchart as _stepchart
from . import textcap as _textcap
from . import textview as _textview
from . import results, rowwire
from .frontend import asset, bundle
from .gone_engine import GoneEngine
from .rowtable import RowTable, newest
from .stepchart import MAX_STEP_POINTS, STEP_KEYS

FLUSH_HZ = 15
STEPS_PER_FLUSH = 32  # steps beyond this in one flush are averaged into buckets
RESULTS_INTERVAL_S = 5.0  # traits + results output refresh while rows run (results.py)


class GenerationWidget(anywidget.AnyWidget):
    """Live view of an engine's rows. `rows=None`: dashboard of every row, present and
    future; otherwise the given rows only (one `%%generate` cell)."""

    _esm = bundle()
    # the text, not the Path: anywidget watches a Path for changes and its watcher keeps
    # every widget made from it alive for good (and with it the rows it shows)
    _css = asset("widget.css").read_text(encoding="utf-8")

    # row dicts: every delta field + "text", a finished row's text cut to a share of a
    # budget (with "cut": the characters left out; textcap.py)
    rows = t.List(t.Dict()).tag(sync=True)
    steps = t.Dict().tag(sync=True)  # compact step history, see module docstring
    header = t.Dict().tag(sync=True)
    seq = t.Int(0).tag(sync=True)  # last delta message folded into the traits
    details = t.Dict().tag(sync=True)  # str(row id) -> row_detail, the rows opened last
    step_details = t.Dict().tag(sync=True)  # str(step) -> step_detail, the steps opened last

    def __init__(self, engine, rows=None, *, title: str = "", max_rows: int = 200,
                 flush_hz: float = FLUSH_HZ, **kwargs):
        super().__init__(**kwargs)
        # Weak: a widget shows rows, it must not keep a closed engine's model alive.
        self._engine_ref, self._gone = weakref.ref(engine), GoneEngine(engine)
        self.dashboard = rows is None
        self.title = title
        self.max_rows = max_rows if self.dashboard else None
        self._period = 1.0 / flush_hz
        self._trait_interval = 3.0 if self.dashboard else 1.0
        src = newest(engine.rows, max_rows) if self.dashboard else list(rows)
        # display order; finished rows held weakly (rowtable.py)
        self._rows = RowTable(src, keep=results.kept_tag, show=results.Ended)
        self._live = set(self._rows)  # rows not yet reported as done
        # rows whose finish has not come: a widget's steps run from its first row's
        # admission to the step its last row ended in, whenever the flushes fall (the
        # tick after that reads a step launched for rows that had ended: not theirs)
        self._open = {i for i in self._rows if not self._rows.done(i)}
        self._sent = {}  # id -> {"text": str, field: last value sent}
        self._seq = 0
        self._pending = []  # StepRecords since the last flush
        self._step0 = None  # the engine step before this widget's first: a run counts from 1
        self._hist = {k: [] for k in STEP_KEYS}
        self._snaps = []
        self._rate = deque()  # (t, tokens) of recent steps, for the aggregate tok/s
        self._hdr_sent = {}
        self._dirty = False  # traits lag behind a finished row
        self._t_traits = 0.0
        self._flusher = None
        self._listening = False
        # The results output beside the widget (results.py): shown by _ipython_display_,
        # kept current by this id.
        self.display_id = f"mlxnb-{uuid.uuid4().hex}"
        self._results_shown = False
        self._pending.extend(self._backfill())
        self._flush(send=False)
        self._write_traits()
        self.on_msg(self._on_front_msg)
        if self._live or self.dashboard:
            engine.add_listener(self._on_event)
            self._listening = True
        if self._live:
            self._wake()

    @property
    def engine(self):
        """The engine while it lives; after that a stand-in with its last figures."""
        eng = self._engine_ref()
        return self._gone if eng is None else eng

    # -- engine events (on the engine loop) -------------------------------------------
    def _on_event(self, kind, obj):
        if kind == "step":
            # (a tick's finishes reach here before its steps: rows that ended in a
            # streak of steps are in those steps' batches)
            if self._open or self._ours(obj):
                self._pending.append(obj)
                self._wake()
        elif kind == "submit":
            if self.dashboard and obj.id not in self._rows:
                self._rows[obj.id] = obj
                self._live.add(obj.id)
                self._open.add(obj.id)
                self._prune()
                self._wake()
        elif kind == "finish" and obj.id in self._rows:
            self._open.discard(obj.id)
            self._dirty = True
            self._wake()

    def _backfill(self):
        """Steps already recorded that belong to this widget (it may be made late)."""
        steps = self.engine.steps
        if not steps:
            return []
        if self.dashboard:
            return list(steps[-MAX_STEP_POINTS:])
        if not self._rows:
            return []
        steps = list(steps)
        t0 = min(r.t_submit for r in self._rows.values())
        i = bisect.bisect_left(steps, t0, key=lambda s: s.t)
        ends = [r.t_done for r in self._rows.values()]
        if None in ends:
            return steps[i:]
        # up to the step that finished the last row (stamped just before or after it)
        j = bisect.bisect_right(steps, max(ends), key=lambda s: s.t)
        out = steps[i:j + 1]
        if out and out[-1].t > max(ends) and not self._ours(out[-1]):
            out.pop()  # a later step, none of its rows this widget's: as a live widget
        return out

    def _ours(self, rec) -> bool:
        """Did one of this widget's rows decode or end in step `rec`?"""
        return any(i in self._rows for i in (*rec.batch_ids, *rec.ended))

    def _prune(self):
        # Dashboard rows are bounded: drop the oldest finished rows (front end: lib.pruneRows).
        if self.max_rows is None or len(self._rows) <= self.max_rows:
            return
        for rid in [i for i in self._rows if self._rows.done(i) and i not in self._live]:
            if len(self._rows) <= self.max_rows:
                break
            del self._rows[rid]
            self._sent.pop(rid, None)

    # -- flushing ------------------------------------------------------------------------
    def _wake(self):
        if self._flusher is not None and not self._flusher.done():
            return
        loop = self.engine.loop
        if not _aio.on_thread(loop):
            loop.call_soon_threadsafe(self._wake)  # a subshell thread: hop onto the loop
            return
        # A fresh context, so the flusher's messages are not tied to the cell that
        # happened to start it (ipykernel 7 routes a task's output to its creating cell).
        self._flusher = contextvars.Context().run(loop.create_task, self._flush_loop())

    async def _flush_loop(self):
        try:
            while True:
                await asyncio.sleep(self._period)
                self._flush()
                if not self._live and not self._pending:
                    self._write_traits()
                    if not self.dashboard:
                        self._detach()  # a finished run needs no more events
                    return
                if self._dirty and time.monotonic() - self._t_traits > self._trait_interval:
                    self._write_traits()
                elif time.monotonic() - self._t_traits > RESULTS_INTERVAL_S:
                    # Both saved forms (widget state, the results output) stay at most
                    # this far behind while rows run; each write resends every row's
                    # text, within textcap.TEXT_BUDGET for the finished ones.
                    self._write_traits()
        finally:
            self._flusher = None

    def _flush(self, send: bool = True) -> None:
        rows = []
        for rid in [i for i in self._rows if i in self._live]:
            r = self._rows.get(rid)
            d = None if r is None else rowwire.delta(r, self._sent)
            if d is not None:
                rows.append(d)
            if r is None or r.done:  # its last delta is out: nothing more to diff against
                self._live.discard(rid)
                self._sent.pop(rid, None)
        if not self._live:
            self._live = set()  # a set keeps its table when emptied; a widget lives long
        if rows and self.dashboard:  # as the front end prunes on each delta (pruneRows)
            self._prune()
        steps = self._take_steps(STEPS_PER_FLUSH if send else MAX_STEP_POINTS)
        hdr = self._header()
        hdiff = {k: v for k, v in hdr.items() if self._hdr_sent.get(k, ...) != v}
        # The clock and the rate drift every flush: alone they are not worth a message.
        news = rows or steps or set(hdiff) - {"now", "tok_s"}
        if news or not send:
            self._hdr_sent = hdr
        if send and news:
            self._seq += 1
            msg = {"type": "delta", "seq": self._seq, "rows": rows}
            if steps:
                msg["steps"] = steps
            if hdiff:
                msg["header"] = hdiff
            self.send(msg)

    def _take_steps(self, max_points: int):
        recs, self._pending = self._pending, []
        if not recs:
            return None
        if self._step0 is None:
            self._step0 = recs[0].step - 1
        for rec in recs:
            self._rate.append((rec.t, rec.tokens or rec.batch_size))
        new = _stepchart.points(recs, max_points)
        new["snap"] = snaps = _stepchart.kv_snapshots(recs, self._rows, len(self._live))
        _stepchart.extend(self._hist, new)
        self._snaps += snaps
        self._snaps = _stepchart.thin_snapshots(self._snaps)
        return new

    def _header(self) -> dict:
        now = self.engine.clock()
        while self._rate and self._rate[0][0] < now - 2.0:
            self._rate.popleft()
        toks = sum(n for _, n in self._rate)
        span = now - self._rate[0][0] if self._rate else 0.0
        return rowwire.header(
            self.engine, now, round(toks / max(span, 0.25), 1) if toks else 0.0,
            live=bool(self._live), mode="dashboard" if self.dashboard else "run",
            title=self.title, max_rows=self.max_rows, step0=self._step0)

    # -- full state ----------------------------------------------------------------------
    def _write_traits(self) -> None:
        steps = {k: list(v) for k, v in self._hist.items()}
        steps["snap"] = list(self._snaps)
        alive = self._rows.values()  # held until the results below are written
        with self.hold_sync():  # one state message for all four traits
            # rows still in _live get more deltas: their text stays whole (textcap.py)
            self.rows = _textcap.cap_rows(self._rows.full(rowwire.full), self._live)
            self.steps = steps
            self.header = self._header()
            self.seq = self._seq
        self._dirty = False
        self._t_traits = time.monotonic()
        self._update_results()
        del alive

    def sync_now(self) -> None:
        """Send what is pending, then write the complete state into the traits, at once.

        Call it before a cell ends (Run.__await__ does) so a saved notebook holds the
        finished widget; views already open see the same state twice, harmlessly."""
        self._flush()
        self._write_traits()

    # -- front-end requests ------------------------------------------------------------
    def _on_front_msg(self, _widget, content, _buffers):
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "stop":
            rid = content.get("id")
            # ids are ints; anything else (a list, a dict) names no row
            row = self._rows.get(rid) if isinstance(rid, int) else None
            if row is not None and not row.done:
                row.cancel()
        elif kind == "stop_all":
            pool = self.engine.rows if self.dashboard else self._rows.values()
            live = [r for r in pool if not r.done]
            if live and hasattr(self.engine, "cancel"):
                self.engine.cancel(live)
            else:
                for r in live:
                    r.cancel()
        elif kind == "row_detail":
            rid = content.get("id")
            row = self._rows.get(rid) if isinstance(rid, int) else None
            start = content.get("from", 0)  # tokens the view already holds
            start = start if isinstance(start, int) and start > 0 else 0
            if row is None and isinstance(rid, int) and rid in self._rows:
                # finished, and no handle holds it any more: its tokens are gone
                self.send({"type": "row_detail", "id": rid, "gone": True, "trace": []})
            if row is not None:
                d = _details.row_detail(row, self.engine, start)
                self.send(d)
                if row.done:  # a finished row's detail no longer changes: keep it
                    whole = d if not start else _details.row_detail(row, self.engine)
                    self.details = _details.keep(self.details, rid, whole)
        elif kind == "step_detail":
            n = content.get("step")
            if isinstance(n, int) and not isinstance(n, bool):
                d = _details.step_detail(self.engine.steps, n, self._rows)
                self.send(d)
                self.step_details = _details.keep_step(self.step_details, d)
        elif kind == "sync":
            self.sync_now()
            # Only a live kernel answers: a view restored from saved widget state whose
            # request goes unanswered shows itself as not live (widget.js).
            self.send({"type": "synced", "seq": self._seq})

    def _detach(self):
        if self._listening:
            self.engine.remove_listener(self._on_event)
            self._listening = False

    def close(self):
        self._detach()
        if self._flusher is not None:
            self._flusher.cancel()
        super().close()

    # -- text fallback ---------------------------------------------------------------------
    def summary_text(self, max_rows: int = 20, width: int = 120) -> str:
        """A compact tqdm-like text view (terminal IPython, nbconvert, text/plain)."""
        return _textview.summary_text(self._header(), self._rows.values(), max_rows, width)

    def results_bundle(self) -> dict:
        """text/plain + text/html of every row as it stands (results.py)."""
        h = self.engine
        return results.bundle(self._rows.shown(), rowwire.short_model_name(
            str(getattr(h, "model_name", "") or "")), self.title)

    def _repr_mimebundle_(self, **kwargs):
        # The widget view, and for frontends without widgets a pointer to the results
        # output (its own snapshot would be stale: outputs are not updated by view id).
        data, meta = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = (f"mlxnb live widget ({len(self._rows)} rows"
                              f"{', dashboard' if self.dashboard else ''}): "
                              "the rows' results are in the output below it")
        return data, meta

    def _ipython_display_(self):
        """Two outputs: the widget, then its results (updated by display id). A
        notebook saved without widget state still shows the results; beside a live
        widget, widget.css hides them (the widget shows the same rows)."""
        from IPython import get_ipython
        from IPython.display import display

        if getattr(get_ipython(), "kernel", None) is None:
            # terminal IPython prints every display and every update: one snapshot
            display({"text/plain": self.summary_text()}, raw=True)
            return
        data, meta = self._repr_mimebundle_()
        display(data, metadata=meta, raw=True)
        display(self.results_bundle(), raw=True, display_id=self.display_id)
        self._results_shown = True

    def _update_results(self) -> None:
        if not self._results_shown:
            return
        try:
            from IPython.display import update_display

            update_display(self.results_bundle(), raw=True, display_id=self.display_id)
        except Exception:  # no kernel to publish on (closing): the last rendering stays
            pass

    def __repr__(self):
        return f"<GenerationWidget {len(self._rows)} rows{' (dashboard)' if self.dashboard else ''}>"
