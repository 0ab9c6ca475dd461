"""Reading a step back on the worker: the one host sync per decode step, then each row
takes its tokens in order (decoding.py: text, stop strings, endings), with its
logprobs and, for a constrained row, its grammar's say. `BatchExecutor` (batch.py)
mixes this in; a pipelined verification's read is wide.py's `read_wide`.
"""

from __future__ import annotations

import math
from typing import List

from .._trace import lap, pc
from ..constraint_results import cut_short, verdict
from ..messages import Emitted, Updates
from ..states import Finish
from .decoding import RowDecoder
from .inflight import InFlight
from .masks import refused
from .wide import read_wide

__all__ = ["ReadBack"]


class ReadBack:
    """The executor's reading of a launched step (its rows, masks and counts are the
    executor's: see batch.py `BatchExecutor`)."""

    def _read(self, inflight: InFlight, updates: Updates, emitted: List[Emitted]) -> None:
        if inflight.accepted is not None:  # a pipelined verification
            (d, a), self._wide_taken = read_wide(self, inflight, updates, emitted)
            self._wide_read = (self._wide_read[0] + d, self._wide_read[1] + a)
            return
        tr = self.tracer
        t0 = pc() if tr else 0.0
        toks = inflight.tokens.tolist()  # the one host sync per step
        if tr:
            t1 = lap(tr, "read.wait", t0)
        lps = self._read_logprobs(inflight) if inflight.logprobs is not None else None
        rows, drop, eos = self.rows, self.drop, self.eos
        for i, rid in enumerate(inflight.row_ids):
            r = rows.get(rid)
            if r is None or rid in drop:
                continue
            if lps is None and r.matcher is None:  # most rows: one token, nothing else
                self.taken += 1
                ending = r.accept(toks[i], None, emitted, eos)
                if ending is not None:
                    self._ended(r, ending, updates)
                continue
            self._take(r, (toks[i],), (None if lps is None else lps.get(i),), inflight,
                       updates, emitted)
        if tr:
            lap(tr, "read.accept", t1)
            tr("read.py", pc() - t1)

    def _take(self, r: RowDecoder, toks, lps, inflight: InFlight, updates: Updates,
              emitted: List[Emitted], drafted: int = 0) -> int:
        """Row r's tokens of one step read back, in order (the first `drafted` of
        them were drafts it accepted), until it ends; how many it read (the one
        that ended it included)."""
        rows, m = self.rows, r.matcher
        for j, tok in enumerate(toks):
            self.taken += 1
            if m is not None:  # (a constrained row reads one token a step: no drafts)
                self.masks.advance(inflight, rows)  # once per step
                if refused(m):  # the row ends before the token, which never shows
                    r.flush(emitted)
                    self._ended(r, self.masks.finish(r, None, self.eos, None), updates)
                    return j + 1
            ending = r.accept(tok, lps[j], emitted, self.eos, j < drafted)
            if m is not None:
                ending = self.masks.finish(
                    r, lambda t, e: r.accept(t, None, emitted, e), self.eos, ending)
                if m.is_error():  # (its next mask failed): what it held shows
                    r.flush(emitted)
            if ending is not None:
                self._ended(r, ending, updates)
                return j + 1
        return len(toks)

    def _drafts_taken(self, r: RowDecoder, drafts: list, accepted: int, toks: list,
                      read: int, updates: Updates) -> tuple:
        """After `_take` read `read` of a verified row's `toks`: its policy learns from
        the whole draft, and its counts show the drafts up to where it ended (a stop
        or EOS inside its accepted drafts ends it there; the drafts after are moot),
        an accepted end-of-sequence draft not among its tokens. (proposed, accepted)
        counted, added to its update."""
        r.spec.verified(len(drafts), accepted)
        if read > accepted:  # it read every accepted draft
            n, kept = len(drafts), accepted
        else:
            n, kept = read, read - (toks[read - 1] in self.eos)
        up = updates.of(r.id)
        up.draft_proposed += n
        up.draft_accepted += kept
        return n, kept

    def _ended(self, r: RowDecoder, ending, updates: Updates) -> None:
        """Row r ended at its latest token: say so and drop it from the batch."""
        rid = r.id
        up = updates.end(rid, ending.reason, ending.error)
        if r.matcher is not None and not r.params.stop and ending.reason != Finish.ERROR:
            # its matcher read exactly the tokens its text decodes from
            # (and its text: a value cut by max_tokens has no capture yet)
            text = r.detok.text
            up.checked, up.constraint_error = True, verdict(
                r.params, r.matcher, text, cut_short(text, ending.reason))
        self.drop.add(rid)
        if rid not in self.ids:
            self.rows.pop(rid, None)
            self.drop.discard(rid)

    def _read_logprobs(self, inflight: InFlight) -> dict:
        lp, ids = inflight.logprobs, inflight.row_ids
        chosen = lp.chosen.tolist()
        top_ids = lp.top_ids.tolist() if lp.top_ids is not None else None
        top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
        out = {}
        for j, i in enumerate(lp.positions):
            k = self.rows[ids[i]].params.logprobs if ids[i] in self.rows else 0
            # tokens the row could not draw (-inf) are not alternatives
            out[i] = {"logprob": chosen[j],
                      "top": [(t, x) for t, x in zip(top_ids[j][:k], top_lp[j][:k])
                              if x != -math.inf] if top_ids else []}
            if lp.allowed and i in lp.allowed:
                out[i]["allowed"] = lp.allowed[i]
        return out
