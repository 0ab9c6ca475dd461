"""When speculation pays, per row: each row's draft length, the chance its drafts hold,
and its pauses (what a step costs, the verification width and the guard that turns
speculation off where it measures slower are steptimes.py's).

Every cost the policy weighs is measured wall time on the worker: a plain decode
step is timed as the pipeline runs it (the device computes step N+1 while the host
reads step N), a verification step as its own wait (speculate.py `observe`: less the
plain step in flight it also waited for, whose tokens that step pays for). So a
width is chosen, and speculation kept on, by tokens per second as they really come
out: on a host-bound GPU, where the pipeline's overlap is most of a plain step's
speed, as on a compute-bound CPU, where each position fed costs.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["RowPolicy", "Pooled", "expected_accepts", "DEFAULT_DRAFT", "MAX_DRAFT"]

DEFAULT_DRAFT = 4  # the adaptive k starts here and stays within [1, MAX_DRAFT]
MAX_DRAFT = 12
FAILS_TO_PAUSE = 2  # consecutive drafts with nothing accepted before a pause
MAX_PAUSE = 64  # steps


class Pooled:
    """Draft-token acceptance over all of a source's rows (decayed): a joining row's
    prior. A row's acceptance is learnt only from its verifications, and a row is
    verified only when its acceptance says that pays; from an even prior a row
    whose verifications cost two plain steps (a host-bound GPU) is never verified,
    however well the rows before it copied. Rows of one notebook experiment tend to
    be alike, so they start from what the rows before them showed."""

    DECAY = 0.95  # per verification of any row
    WEIGHT = 2.0  # the prior counts as this many draft tokens of the row's own

    def __init__(self):
        self.held, self.missed = 1.0, 1.0

    def add(self, held: float, missed: float) -> None:
        self.held = self.DECAY * self.held + held
        self.missed = self.DECAY * self.missed + missed

    def prior(self) -> tuple:
        q = self.held / (self.held + self.missed)
        return self.WEIGHT * q, self.WEIGHT * (1 - q)


class RowPolicy:
    """One row's speculation policy, whatever its drafts come from: how many tokens
    it drafts (`k`, grown while drafts hold, halved when none holds), the
    chance its next draft token holds (`q`), and a pause, doubling with every failed
    probe, while its drafts keep failing: on free-form text drafts stop costing.
    A draft source's per-row state subclasses it (lookup.py `RowLookup`)."""

    def __init__(self, num_draft: int = 0, pool: Optional[Pooled] = None):
        self.fixed = num_draft > 0  # a user-given k: neither adapted nor paused
        self.k_max = num_draft if self.fixed else MAX_DRAFT
        self.k = num_draft if self.fixed else DEFAULT_DRAFT
        self.fails = 0  # consecutive drafts with nothing accepted
        self.pause = 0  # steps left without drafting
        self.next_pause = 4
        self.proposed = self.accepted = 0  # totals (tests, status)
        self.stale = False  # its last verification rejected a draft (wide.py)
        # per draft token: held after held ones (successes) and the first that did
        # not (failures), decayed: q is the chance the next draft token holds
        self.pool = pool
        self._held, self._missed = pool.prior() if pool is not None else (1.0, 1.0)

    def extend(self, toks) -> None:
        """The row took these tokens (decoding.py, as they are read)."""

    def ready(self) -> bool:
        """Host-only, before the step in flight is read: would the row draft after
        one more token? (A source that always drafts says True.)"""
        return True

    def paused(self) -> bool:
        """Is it pausing this step? (A step passes: one step less to pause.)"""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def verified(self, proposed: int, accepted: int) -> None:
        """After a verification of `proposed` drafts of which `accepted` held
        (proposed 0: it was expected to draft and had nothing: a failure too)."""
        self.proposed += proposed
        self.accepted += accepted
        d = 0.8
        missed = float(accepted < proposed or not proposed)
        self._held = d * self._held + accepted
        self._missed = d * self._missed + missed
        if self.pool is not None:
            self.pool.add(accepted, missed)
        if accepted == 0 and not self.fixed:  # a user-given k keeps drafting
            self.fails += 1
            if self.fails >= FAILS_TO_PAUSE:
                self.pause, self.fails = self.next_pause, 0
                self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        else:
            self.fails = 0
            self.next_pause = 4
        if not self.fixed and proposed:
            # all accepted: reach further. Some held: keep the reach -- a copy with
            # an edit in it goes on after the edit, and the width verified is the
            # cost model's choice from q (`best_width`), not k's. None held: halve.
            self.k = (min(self.k + 2, self.k_max) if accepted == proposed
                      else self.k if accepted else max(1, self.k // 2))

    @property
    def q(self) -> float:
        return self._held / (self._held + self._missed)

    @property
    def rate(self) -> Optional[float]:
        return self.accepted / self.proposed if self.proposed else None


def expected_accepts(q: float, k: int) -> float:
    """Drafts held of k when each holds with probability q given the ones before."""
    if k <= 0:
        return 0.0
    return q * (1 - q ** k) / (1 - q) if q < 1 else float(k)
