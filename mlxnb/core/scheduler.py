"""Scheduling policy: which queued rows start now. Pure Python, no MLX.

Admission is strict FIFO under two limits: `max_batch` rows in flight, and a KV byte
budget checked against the *projected peak* of the running set. The batch cache is
left-padded (every row occupies the batch's full length), so the projection is
    peak = max over t of  sum over rows still alive at t of bytes(L_now + t)
where L_now is the longest row now and t runs over the steps at which rows finish.
A row without a token yet is charged as prefilling (a sliding window then also
holds a prefill chunk), one with tokens as decoding. That is what the real
allocation can reach, so reported KV never exceeds the budget.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Deque, Dict, Optional

from .._text import fmt_bytes
from .rowtrace import BATCH_FULL, KV_BUDGET


def _length(row) -> int:
    return row.prompt_tokens + len(row.tokens)


def _prefilling(row) -> bool:
    """Before its first token a row is prefilled; after it, it only decodes."""
    return not row.tokens


def _remaining(row) -> int:
    return max(0, row.params.max_tokens - len(row.tokens))


class Scheduler:
    def __init__(self, max_batch: int, kv_budget: Optional[int],
                 bytes_for: Callable[[int, bool], int]):
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        # bytes one row's cache holds at a given length, prefilling or decoding
        self.bytes_for = bytes_for
        self.queue: Deque = deque()
        self.active: Dict[int, object] = {}  # row id -> admitted Row
        # Why rows wait: how often admission stopped at a full batch or at the KV
        # budget, and the counts each queued row saw on arrival (waited_for).
        self.blocked: Counter = Counter()
        self._seen: Dict[int, Counter] = {}
        self._why: Dict[int, list] = {}  # admitted rows' reasons, until asked

    # -- questions ---------------------------------------------------------------
    def row_bytes(self, prompt_len: int, max_tokens: int) -> int:
        return self.bytes_for(prompt_len + max_tokens)

    def never_fits(self, prompt_len: int, max_tokens: int) -> Optional[str]:
        if self.kv_budget is None:
            return None
        need = self.row_bytes(prompt_len, max_tokens)
        if need <= self.kv_budget:
            return None
        return (f"this row needs {fmt_bytes(need)} of KV cache ({prompt_len} prompt + "
                f"{max_tokens} new tokens) but kv_budget is {fmt_bytes(self.kv_budget)}; "
                f"raise kv_budget, lower max_tokens or shorten the prompt")

    def projected_peak(self, rows: list) -> int:
        """Rows' lengths and remaining tokens are read off the rows themselves."""
        if not rows:
            return 0
        base = max(_length(r) for r in rows)
        peak = 0
        alive = [0, 0]  # rows still alive: decoding, prefilling
        for r in rows:
            alive[_prefilling(r)] += 1
        for rem, pre in sorted((_remaining(r), _prefilling(r)) for r in rows):
            n = base + rem
            peak = max(peak, alive[0] * self.bytes_for(n, False)
                       + alive[1] * self.bytes_for(n, True))
            alive[pre] -= 1
        return peak

    # -- bookkeeping -------------------------------------------------------------
    def enqueue(self, row) -> None:
        self.queue.append(row)
        self._seen[row.id] = self.blocked.copy()

    def waited_for(self, row) -> list:
        """What held an admitted row in the queue: "batch full", "KV budget" (each
        one admission stopped at while it waited), or [] (it waited only for a step)."""
        return self._why.pop(row.id, [])

    def admit(self) -> list:
        """Pop the rows that may start now, in FIFO order (stops at the first misfit)."""
        out = []
        rows = list(self.active.values())
        while self.queue and len(self.active) < self.max_batch:
            row = self.queue[0]
            if (self.kv_budget is not None and rows
                    and self.projected_peak(rows + [row]) > self.kv_budget):
                self.blocked[KV_BUDGET] += 1
                break
            self.queue.popleft()
            seen = self._seen.pop(row.id, None)
            if seen is not None:
                self._why[row.id] = [w for w in (BATCH_FULL, KV_BUDGET)
                                     if self.blocked[w] > seen[w]]
            self.active[row.id] = row
            rows.append(row)
            out.append(row)
        else:
            if self.queue:
                self.blocked[BATCH_FULL] += 1
        return out

    def release(self, row_id: int) -> None:
        self.active.pop(row_id, None)

    def clear(self) -> None:
        """Forget every row (the engine has ended them all)."""
        self.queue.clear()
        self.active.clear()
        self._seen.clear()
        self._why.clear()

    def dequeue(self, row) -> bool:
        try:
            self.queue.remove(row)
            self._seen.pop(row.id, None)
            return True
        except ValueError:
            return False

