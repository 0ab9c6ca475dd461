"""Prompt-lookup drafts and each row's speculation policy (host side, worker thread).

A row that speculates keeps its whole token sequence (prompt + output) and, for each
n-gram length n, where the latest occurrence of every n-gram was followed by a token.
Its draft is the k tokens that followed the latest earlier occurrence of its last n
tokens, the longest n first (MAX_N down to MIN_N): an exact copy of the prompt or of
its own output, the common case in extraction, rewriting and quoting.

How many tokens a row drafts adapts to what it got accepted (`RowLookup.k`), and a
row whose drafts keep failing pauses its drafting for a number of steps that doubles
with every failed probe: on free-form text drafts stop costing anything.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

__all__ = ["RowLookup", "MAX_N", "MIN_N", "DEFAULT_DRAFT", "MAX_DRAFT"]

MAX_N = 3  # longest n-gram matched
MIN_N = 2  # a single-token match predicts little (measured: it lowers acceptance)
DEFAULT_DRAFT = 4  # the adaptive k starts here and stays within [1, MAX_DRAFT]
MAX_DRAFT = 8
FAILS_TO_PAUSE = 2  # consecutive drafts with nothing accepted before a pause
MAX_PAUSE = 64  # steps


class RowLookup:
    """One row's n-gram index, draft length and pause state."""

    def __init__(self, ids: List[int], num_draft: int = 0):
        self.seq: List[int] = []
        self.index: List[Dict[Tuple[int, ...], int]] = [dict() for _ in range(MAX_N + 1)]
        self.fixed = num_draft > 0  # a user-given k: neither adapted nor paused
        self.k_max = num_draft if self.fixed else MAX_DRAFT
        self.k = num_draft if self.fixed else DEFAULT_DRAFT
        self.fails = 0  # consecutive drafts with nothing accepted
        self.pause = 0  # steps left without drafting
        self.next_pause = 4
        self.proposed = self.accepted = 0  # totals (tests, status)
        self.was_primed = False
        # per draft token: held after held ones (successes) and the first that did
        # not (failures), decayed: q is the chance the next draft token holds
        self._held, self._missed = 1.0, 1.0
        self.extend(ids)

    def extend(self, toks) -> None:
        """Append tokens; index every n-gram that now has a token after it."""
        seq, index = self.seq, self.index
        for t in toks:
            L = len(seq)
            for n in range(MIN_N, MAX_N + 1):
                if L >= n:
                    index[n][tuple(seq[L - n:L])] = L  # the n-gram ending before L
            seq.append(t)

    def paused(self) -> bool:
        """Is it pausing this step? (A step passes: one step less to pause.)"""
        self.was_primed = False
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def primed(self) -> bool:
        """Do the row's last MAX_N tokens occur earlier? Then its next token, once
        read, likely extends the match: worth reading it at once to draft. (A
        shorter match is common in any text and predicts little.)"""
        seq = self.seq
        self.was_primed = len(seq) > MAX_N and tuple(seq[-MAX_N:]) in self.index[MAX_N]
        return self.was_primed

    def no_draft(self) -> None:
        """It was primed, its next token was read at once, and nothing matched: a
        read for nothing, counted as a draft that failed."""
        self.was_primed = False
        self.verified(0, 0)

    def draft(self, limit: int) -> List[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of
        the row's last n tokens; [] when paused or nothing matches."""
        if self.pause > 0:
            return []
        k = min(self.k, limit)
        if k <= 0:
            return []
        seq = self.seq
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(seq) <= n:
                continue
            p = self.index[n].get(tuple(seq[-n:]))
            if p is not None:
                return seq[p:p + k]
        return []

    def verified(self, proposed: int, accepted: int) -> None:
        """After a verification of `proposed` drafts of which `accepted` held."""
        self.proposed += proposed
        self.accepted += accepted
        d = 0.8
        self._held = d * self._held + accepted
        self._missed = d * self._missed + (accepted < proposed or not proposed)
        if accepted == 0 and not self.fixed:  # a user-given k keeps drafting
            self.fails += 1
            if self.fails >= FAILS_TO_PAUSE:
                self.pause, self.fails = self.next_pause, 0
                self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        else:
            self.fails = 0
            self.next_pause = 4
        if not self.fixed:
            # all accepted: reach further; otherwise draft what held, plus one
            if proposed:
                self.k = (min(self.k + 2, self.k_max) if accepted == proposed
                          else max(1, min(accepted + 1, self.k_max)))

    @property
    def q(self) -> float:
        return self._held / (self._held + self._missed)

    @property
    def rate(self) -> Optional[float]:
        return self.accepted / self.proposed if self.proposed else None
