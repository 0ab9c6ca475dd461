"""Speculative decoding inside the running batch: prompt-lookup drafts verified by one
batched target forward, on the worker thread.

A verification step feeds every batch row [its last token, its drafts] ([B, W],
W = 1 + the longest draft; rows with fewer drafts, or none, are padded and their
extra positions discarded) and samples each row's W positions with the row's own
sampler (sampling.py `sample_wide`): position j with the noise the row's token j
steps ahead would get. A row takes its drafts while they equal the tokens sampled
after them, then the token sampled at the first mismatch (or after the last draft).

So a row's tokens are exactly those it gets without speculation, greedy or sampled:
a greedy row's are the argmax at each position; a sampled row's are its Gumbel-max
draws, which for a point-mass draft x is the rejection rule that keeps the target
distribution -- x is accepted with probability p(x) (its filtered, tempered
probability), and on rejection the token is drawn from p with x removed,
renormalised (the Gumbel-max draw given that it is not x) -- with the uniforms taken
from the row's counter-based seed, so a seeded row is the same alone or in any
batch. Rows with logits processors or a constraint do not draft (their one token
comes from position 0, processed and masked as in a plain step); logprobs are those
of each position's distribution. Rejected positions leave the cache (rollback.py).

A verification runs one of two ways. Pipelined (wide.py): launched like a plain step
while the step before is still computing, read back a step later; acceptance, the
next input and the rollback of rejected positions happen on the device, and a row's
proposal follows the tokens read so far plus what the step in flight is expected to
give (its drafts, all taken, and a guess of its last token: the first proposed
token). Read back at once (`step`, verify.py; for rows that need the host each step
-- logprobs, logits processors, a constraint -- and for sliding-window or quantized
caches): launched while the step in flight computes, with the same guess, then both
are read and the cache rolled back on the host (rollback.py). Either way the drafts
are checked against what the model computes after the row's real tokens, so a wrong
guess only makes drafts that fail. The policy (specpolicy.py, steptimes.py) verifies
when a row, not paused, is `ready` and verifying is expected to give more tokens per
second than a plain step -- each row's acceptance so far against the measured wall
time of plain and verifying steps at this batch size -- at the width that gives the
most, picks the way that measured faster, and holds speculation off at a batch size
where speculating steps measure slower than plain ones.

Draft sources. Rows name theirs in `SamplingParams.speculate`; the verifier asks a
source (registered by its `mode`, `Speculation.register`) two things, on the worker
thread:

    attach(row, ids) -> RowPolicy | None
        A joining row (a decoding.RowDecoder; `ids` its prompt tokens): the row's
        per-row state, kept as `row.spec`. It subclasses specpolicy.RowPolicy (draft
        length `k`, pauses, acceptance `q`), gets every token the row takes, in
        order, through `extend(tokens)` (as they are read: one or two steps behind
        the device), and says through `ready()`, host-only, whether it would have a
        proposal now. None: the row does not speculate.
    propose(rows, limits, after) -> List[List[int]]
        For each row (RowDecoders in batch order, only rows of this source, none
        paused): up to limits[i] tokens proposed to follow the tokens it has taken
        so far and then after[i] (tokens assumed taken by the step in flight; often
        []). The verifier uses the first as its guess of the step in flight's last
        token when one is in flight, the rest as drafts. [] = nothing this step.

The verifier checks every row's drafts in one batched target forward, feeds the
result back through `row.spec.verified(proposed, accepted)`, and rolls back the
cache.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .._trace import lap, pc
from ..messages import Emitted, Updates
from .inflight import InFlight
from .lookup import LookupSource
from .rollback import unsupported_reason
from .steptimes import StepTimes, best_width
from .verify import verify
from .wide import flat_only, launch_wide, trim

__all__ = ["Speculation", "MAX_SPEC_BATCH"]

MAX_SPEC_BATCH = 32  # larger batches are bound by the device: extra positions cost


class Speculation:
    """The executor's speculation state: draft sources, the policy's measurements,
    and the verification step."""

    def __init__(self, row_cache: list):
        self.off_reason = unsupported_reason(row_cache)  # None: rows may speculate
        self.times = StepTimes()
        self.sources: Dict[str, object] = {}
        self.register(LookupSource())
        self._ready: List[int] = []  # batch positions of rows ready this step
        self.drained = False  # the last `step` read the step in flight first
        self.flat = flat_only(row_cache)  # verification can be pipelined (wide.py)
        self.slack = 0  # rejected positions that may sit as padding (wide.py)
        # counts (tests, bench): trims, pipelined and read-back verifications
        self.trims = self.wide = self.sync = 0
        self.draft = None  # draft.py: a draft model's source, when the engine has one
        self._draft_due = False  # a draft row's draft is due this step
        self._considered = False  # this step some row was ready to draft
        self._regime = None  # "on" or "held" (the guard): how this step is judged

    def add_draft(self, source) -> None:
        """Register a draft model's source (draft.py). Its rows' drafting schedule is
        their own: whenever one is due the step verifies, drained (not pipelined),
        with the rejection rule for drawing rows (`judge`) and the draft's own
        cache rolled back after (`verified`)."""
        if self.off_reason is None:
            self.draft = source
            self.register(source)

    @property
    def facts(self) -> str:
        return self.off_reason or "/".join(getattr(s, "facts", m)
                                           for m, s in self.sources.items())

    def register(self, source) -> None:
        """Add a draft source (see the module docstring) under its `mode`."""
        self.sources[source.mode] = source

    def attach(self, r, ids: List[int]) -> None:
        """Give a joining row its draft state if it speculates and can."""
        src = self.sources.get(r.params.speculate)
        if (src is not None and self.off_reason is None and not r.processors
                and r.matcher is None):
            r.spec = src.attach(r, ids)

    def observe(self, rows: int, seconds: float, verified: Optional[tuple],
                drained: bool, pipelined: bool, wide: bool = False,
                wide_read: Optional[tuple] = None, taken: Optional[int] = None) -> None:
        """A decode-only step of `rows` rows took `seconds` of wall time. It is the
        cost of what it waited for: a verification read at once (`verified`; less
        the plain step in flight when it read one too), a pipelined one it read
        (`wide_read`: its width and tokens; the step that
        reads one waits for its compute, as the step that launched it waited for
        the one before), a plain step that read the step in flight to draft and
        did not (`drained`), or a plain step of the pipeline that read a plain one
        (`pipelined`; one launching a pipelined verification (`wide`) is neither).
        `taken`: the tokens the rows took this step, for the guard's judging of
        every step while speculation is on or held off (`StepTimes.observe_regime`)."""
        learnt = self._observe(rows, seconds, verified, drained, pipelined, wide, wide_read)
        if self._regime is not None and taken is not None and learnt:
            self.times.observe_regime(rows, seconds, taken, self._regime == "held")

    def _observe(self, rows, seconds, verified, drained, pipelined, wide, wide_read) -> bool:
        t = self.times
        if verified is not None:
            own = seconds
            if drained and t.plain_s(rows):
                # it waited for the step in flight too: a plain step's compute on a
                # device that runs one at a time, which that step's tokens pay for.
                # The verification's own cost is the rest (at least half: where the
                # host, not the device, bounds a step, the two overlap)
                own = max(seconds - t.plain_s(rows), seconds / 2)
            learnt = t.observe_spec(rows, verified[3], own, verified[2])
            if drained:  # those tokens count to its way too
                t.observe_flow(rows, seconds - own, rows, "sync")
            return learnt
        if wide_read is not None:
            return t.observe_spec(rows, wide_read[0], seconds, wide_read[1], "wide")
        if drained:
            return t.observe_spec(rows, 1, seconds, rows)
        if self._considered:  # a row could draft: the way in effect (`way`) counts
            t.observe_flow(rows, seconds, rows if pipelined else 0)
        if pipelined and not wide:
            t.observe_plain(rows, seconds)
        return True

    def wanted(self, ex) -> bool:
        """Worth drafting this step? Some row, not paused, is ready, and the best
        case (each such row drafting its k) would pay; counts down paused rows'
        pauses and the guard's hold."""
        self._considered = False
        self._regime = None
        self._draft_due = self.draft is not None and self.draft.wanted(ex)
        if self._draft_due:
            self._ready = []
            return True
        rows = ex._batch_rows
        B = len(rows)
        if not ex._any_spec or B > MAX_SPEC_BATCH:
            return False
        held = not self.times.allowed(B)
        # a user-given num_draft verifies whatever it costs: not the guard's to judge
        self._regime = None if ex._any_fixed_draft else "held" if held else "on"
        if ex.inflight is not None and ex.inflight.firsts:
            return False  # a first token to show: keep the plain step (its TTFT)
        qs, ks, fixed, ready = [], [], False, []
        for i, r in enumerate(rows):
            s = r.spec
            if s is not None and not s.paused() and s.ready():
                fixed = fixed or s.fixed  # a user-given num_draft: whatever it costs
                qs.append(s.q)
                ks.append(max(0, min(s.k, r.params.max_tokens - r.launched - 2)))
                ready.append(i)
                continue
            qs.append(0.0)
            ks.append(0)
        self._ready = ready
        # a step where some row could draft, whether or not it does: where the two
        # ways of verifying differ (the others are the text's, the same for both)
        self._considered = bool(ready)
        if not any(ks):
            return False
        if held and not fixed:  # the guard holds it off
            return False
        ahead = ex.inflight is not None and not ex._any_constrained
        return fixed or best_width(self.times, qs, ks, qs if ahead else None) > 1

    def step(self, ex, updates: Updates, emitted: List[Emitted]) -> Optional[tuple]:
        """Verify drafts for this step if that is expected to pay: (drafts proposed,
        accepted, tokens taken, width), else None (the caller launches a plain
        step). `drained`: whether it read the step in flight before launching.

        With a step in flight (and no constrained row, whose mask needs the token
        in flight read first), it drafts one step ahead: a row's proposal follows
        the tokens already read, its first token a guess for the token in flight,
        the rest its drafts; the verification feeds [the token in flight, as it
        computes, + the drafts], and the step in flight is read while the
        verification computes. The drafts are checked against what the model
        computes after the real token, so the rule is exact whatever the guess:
        a wrong guess only makes drafts that fail. No proposal: nothing was read,
        and the plain step that follows stays pipelined."""
        done = ex.inflight
        tr = ex.tracer
        t = pc() if tr else 0.0
        # a draft model drafts from the token in flight itself: read it first
        ahead = done is not None and not ex._any_constrained and not self._draft_due
        self.drained = done is not None and not ahead
        if self.drained:
            ex.inflight = None
            ex._read(done, updates, emitted)
            if tr:
                t = lap(tr, "verify.read_before", t)
        rows, drop = ex._batch_rows, ex.drop
        props = self._propose(rows, drop, [[] for _ in rows], ahead)
        # drafting ahead, the first proposed token stands for the one in flight
        drafts = [p[1:] for p in props] if ahead else props
        # the guess must hold too
        w = self._width(rows, drop, drafts, lambda i, q: q if ahead else 1.0)
        if tr:
            lap(tr, "verify.propose", t)
        if w == 1:
            if self._draft_due:  # nothing verifies the draft's proposals: none kept
                self.draft.verified(list(ex.ids), [0] * len(ex.ids))
            return None
        ex.inflight = None
        self.drained = done is not None
        self.sync += 1
        return verify(ex, [d[:w - 1] for d in drafts], done if ahead else None,
                      self.draft, updates, emitted)

    def _width(self, rows, drop, drafts: List[List[int]], live_of) -> int:
        """The verification's width (1 + drafts kept per row) by the policy, 1 for
        none: `live_of(i, q)` is the chance row i's drafts are still live given its
        draft-token acceptance q. A ready row with nothing to draft counts a failure."""
        qs, live, forced = [], [], 0
        for i, (r, d) in enumerate(zip(rows, drafts)):
            s = r.spec
            q = s.q if s is not None else 0.0
            qs.append(q)
            live.append(live_of(i, q))
            if d and s.fixed:  # the user's num_draft: verified whatever it costs
                forced = max(forced, len(d))
        for i in self._ready:
            if not drafts[i] and rows[i].id not in drop:
                rows[i].spec.verified(0, 0)
        if not any(drafts):
            return 1
        return max(best_width(self.times, qs, [len(d) for d in drafts], live), forced + 1)

    def _propose(self, rows, drop, after: List[List[int]], ahead: bool) -> List[List[int]]:
        """Each batch row's proposal from its own source, following its tokens read
        and `after` (those assumed of the step in flight): its k drafts (one more,
        the guess, when drafting `ahead`), within its max_tokens."""
        out: List[List[int]] = [[] for _ in rows]
        by_mode: Dict[str, List[int]] = {}
        # A draft model proposes only when its draft is due (a drained verification
        # that rolls its cache back after, `DraftSource.verified`): a proposal for a
        # step that is not one would leave its state for a later step to misread.
        drafting = self._draft_due and not ahead
        for i, r in enumerate(rows):
            if r.spec is not None and r.id not in drop and r.spec.pause == 0 and (
                    drafting or r.params.speculate != "draft"):
                by_mode.setdefault(r.params.speculate, []).append(i)
        for mode, idx in by_mode.items():
            sub = [rows[i] for i in idx]
            # launched counts the step in flight once: drafts may fill the rest
            limits = [min(r.spec.k + ahead, r.params.max_tokens - r.launched - 1 + ahead
                          - len(after[i])) for i, r in zip(idx, sub)]
            props = self.sources[mode].propose(sub, limits, [after[i] for i in idx])
            for i, n, d in zip(idx, limits, props):
                out[i] = list(d)[:max(0, n)]
        return out

    def settle(self, ex) -> None:
        """Before a plain launch: trim the padding pipelined verifications left,
        once none of them is in flight (then it is computed: no wait)."""
        if self.slack and (ex.inflight is None or ex.inflight.accepted is None):
            trim(ex)

    def pipelined(self, ex) -> bool:
        """Launch this batch's verification without reading it back at once?
        Where it can -- plain KV caches only, no row whose step needs the host
        (logprobs, logits processors, a constraint: they verify in `step`) -- and
        where the policy measured it the faster way (`StepTimes.way`)."""
        return (self.flat and not ex._want_lp and not ex._any_procs
                and not ex._any_constrained and not self._draft_due
                and self.times.way(len(ex._batch_rows)) == "wide")

    def launch(self, ex) -> Optional[InFlight]:
        """A pipelined verification (wide.py) if one is expected to pay, else None
        (the caller launches a plain step). Nothing is read here: proposals follow
        the tokens read so far and what the step in flight is assumed to give --
        a verification's drafts unless the one before it showed them stale, then
        its next token, which the proposal's first token guesses."""
        done = ex.inflight
        tr = ex.tracer
        t = pc() if tr else 0.0
        rows, drop = ex._batch_rows, ex.drop
        ahead = done is not None
        after: List[List[int]] = [[] for _ in rows]
        if done is not None and done.drafts:
            for i, r in enumerate(rows):
                dr = done.drafts.get(r.id)
                if dr and r.spec is not None and not r.spec.stale:
                    after[i] = dr
        props = self._propose(rows, drop, after, ahead)
        drafts = [p[1:] for p in props] if ahead else props
        # what it assumed held
        w = self._width(rows, drop, drafts,
                        lambda i, q: q ** (len(after[i]) + 1) if ahead else 1.0)
        if tr:
            lap(tr, "wide.propose", t)
        if w == 1:
            return None
        self.wide += 1
        return launch_wide(ex, [d[:w - 1] for d in drafts])
