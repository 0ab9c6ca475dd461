"""How a worker's tick report reaches the loop's rows: tokens, text, states, step
records, finished rows. `Engine` mixes this in; `_apply` is the one place worker
results touch a `Row` (the threading rule, core/__init__.py)."""

from __future__ import annotations

from typing import Optional

from . import rowtrace
from .constraint_params import kind_of
from .messages import TickReport
from .rows import Row, StepRecord
from .states import Finish
from ._trace import timed

_KEEP_STEPS = 200_000  # step records kept in `Engine.steps` (oldest dropped first)


class Reports:
    @timed("apply")
    def _apply(self, report: TickReport, dt: float):
        """The one place worker results reach rows: tokens, text deltas, states."""
        now = self.clock()
        live = self._live
        # the steps this tick took get the next numbers; prefill rides on its first
        # (a tick with prefill work takes one step), rows end in its last
        first, last = self._nsteps, self._nsteps + len(report.steps) - 1
        first_s = report.steps[0].seconds + dt - sum(st.seconds for st in report.steps) \
            if report.steps else 0.0
        chunks, ended = {}, []
        for e in report.emitted:
            row = live.get(e.row_id)
            if row is None:  # ended on this side first (cancel, close)
                continue
            if e.token is not None:
                if row.t_first is None:
                    row.t_first = now
                if e.drafted:
                    row.drafted.append(len(row.tokens))
                row.tokens.append(e.token)
                if e.logprob is not None:
                    row.logprobs.append(e.logprob)
            if e.text:
                if e.drafted:
                    row.mark_drafted(len(row.text), len(row.text) + len(e.text))
                row.text += e.text  # rebinds a new str: readers see old or new, whole
        for rid, up in report.updates.items():
            row = live.get(rid)
            if row is None:
                continue
            if up.state:
                row.state = up.state
            if up.cached_tokens is not None and not row.cached_tokens:
                rowtrace.note_prefix(row, now - dt, up.cached_tokens)
            if up.prefill_done is not None:
                n = up.prefill_done - max(row.prefill_done, up.cached_tokens or 0)
                if n > 0:
                    chunks[rid] = n
                    rowtrace.note_chunk(row, first, now - dt + first_s, first_s, n)
                row.prefill_done = up.prefill_done
            if up.cached_tokens is not None:
                row.cached_tokens = up.cached_tokens
            if up.draft_proposed:
                row.draft_proposed += up.draft_proposed
                row.draft_accepted += up.draft_accepted
                if row.params.speculate == "draft":  # the draft model's record (status)
                    self.draft_proposed += up.draft_proposed
                    self.draft_accepted += up.draft_accepted
            if up.finish:
                ended.append(rid)
                rowtrace.note_end(row, last if report.steps else None)
                if row.t_first is None and up.finish == Finish.STOP:
                    row.t_first = now
                self._end(row, up.finish, up.error, checked=up.checked,
                          constraint_error=up.constraint_error)
        # The first step also carries the loop's share of the round trip.
        worker = sum(st.seconds for st in report.steps)
        t = now - dt
        for i, st in enumerate(report.steps):
            secs = st.seconds + ((dt - worker) if i == 0 else 0.0)
            t += secs
            split = tuple(st.split) + ((dt - worker) if i == 0 else 0.0,) if st.split else ()
            rec = StepRecord(self._nsteps, t, secs, st.decoded, st.prefill_tokens,
                             st.kv_bytes, st.batch_ids, st.batch_share, st.prefill_bytes,
                             st.read, prefill_rows=chunks if i == 0 else None,
                             ended=tuple(ended) if self._nsteps == last else (),
                             split=split, kv_budget=self.kv_budget,
                             drafted=st.drafted, accepted=st.accepted)
            self._nsteps += 1
            self.steps.append(rec)
            self._notify("step", rec)
        if len(self.steps) > _KEEP_STEPS + _KEEP_STEPS // 16:  # a kernel may run for days
            del self.steps[:len(self.steps) - _KEEP_STEPS]

    def _end(self, row: Row, reason: Finish, error: Optional[str] = None, *,
             checked: bool = False, constraint_error: Optional[str] = None):
        """Finish a row (on the loop): its last fields, its future, its callbacks.
        A constrained row's text is checked here unless the worker `checked` it."""
        self.scheduler.release(row.id)
        if row.done:
            return
        self._live.pop(row.id, None)
        self._stopping.discard(row.id)
        self._held.pop(row.id, None)
        self._finished[row.id] = row
        self.finished[reason] += 1
        if checked:
            row.constraint_error = constraint_error
        elif reason in (Finish.STOP, Finish.LENGTH) and kind_of(row.params) is not None:
            try:
                row.constraint_error = self.constraints.check(row.params, row.text, reason,
                                                              row.tokens)
            except Exception as e:  # the row's result stands; the check says it failed
                row.constraint_error = f"could not be checked: {type(e).__name__}: {e}"
        row._finish(reason, error)
        self._notify("finish", row)

