"""Prompt-lookup drafts (host side, worker thread): the draft source `lookup`.

A row that speculates keeps its whole token sequence (prompt + output) and, for each
n-gram length n, where the latest occurrence of every n-gram was followed by a token.
Its draft is the k tokens that followed the latest earlier occurrence of its last n
tokens, the longest n first (MAX_N down to MIN_N): an exact copy of the prompt or of
its own output, the common case in extraction, rewriting and quoting. How many tokens
it drafts, and when it pauses, is its `RowPolicy` (specpolicy.py).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .specpolicy import DEFAULT_DRAFT, MAX_DRAFT, Pooled, RowPolicy

__all__ = ["LookupSource", "RowLookup", "MAX_N", "MIN_N", "DEFAULT_DRAFT", "MAX_DRAFT"]

MAX_N = 3  # longest n-gram matched
MIN_N = 2  # a single-token match predicts little (measured: it lowers acceptance)
SURE = 0.6  # a row whose drafts hold this often drafts on a MIN_N match too


class RowLookup(RowPolicy):
    """One row's n-gram index, with its draft policy."""

    def __init__(self, ids: List[int], num_draft: int = 0, pool: Pooled = None):
        super().__init__(num_draft, pool)
        self.seq: List[int] = []
        self.index: List[Dict[Tuple[int, ...], int]] = [dict() for _ in range(MAX_N + 1)]
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

    def ready(self) -> bool:
        """Do the row's last MAX_N tokens occur earlier (MIN_N for a row whose drafts
        mostly hold: it is copying, and resumes after a changed token sooner)? Then
        its next token likely extends the match. (A shorter match is common in any
        text and predicts little.)"""
        seq = self.seq
        for n in (MAX_N, MIN_N) if self.q >= SURE else (MAX_N,):
            if len(seq) > n and tuple(seq[-n:]) in self.index[n]:
                return True
        return False

    def draft(self, limit: int) -> List[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of
        the row's last n tokens; [] when paused or nothing matches."""
        return [] if self.pause > 0 else self.follow(min(self.k, limit))

    def follow(self, k: int, after: List[int] = ()) -> List[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n
        tokens of the row's tokens + `after`, the longest n first."""
        if k <= 0:
            return []
        seq = self.seq
        tail = (seq[-MAX_N:] + list(after))[-MAX_N:] if after else seq[-MAX_N:]
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(tail) < n or len(seq) <= n:
                continue
            p = self.index[n].get(tuple(tail[-n:]))
            if p is not None:
                return seq[p:p + k]
        return []


class LookupSource:
    """Prompt lookup as a draft source (speculate.py `DraftSource`)."""

    mode = "lookup"

    def __init__(self):
        self.pool = Pooled()  # the acceptance of every lookup row so far: a prior

    def attach(self, row, ids: List[int]) -> RowLookup:
        return RowLookup(ids, row.params.num_draft, self.pool)

    def propose(self, rows, limits: List[int], after: List[List[int]]) -> List[List[int]]:
        return [r.spec.follow(n, a) for r, n, a in zip(rows, limits, after)]
