"""Scheduling policy: which queued rows start now. Pure Python, no MLX.

Admission is strict FIFO under two limits: `max_batch` rows in flight, and a KV byte
budget checked against the *projected peak* of the running set. The batch cache is
left-padded (every row occupies the batch's full length), so the projection is
    peak = max over t of  |rows still alive at t| * bytes(L_now + t)
where L_now is the longest row now and t runs over the steps at which rows finish.
That is what the real allocation can reach, so reported KV never exceeds the budget.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, Optional

from .._text import fmt_bytes


def _length(row) -> int:
    return row.prompt_tokens + len(row.tokens)


def _remaining(row) -> int:
    return max(0, row.params.max_tokens - len(row.tokens))


class Scheduler:
    def __init__(self, max_batch: int, kv_budget: Optional[int],
                 bytes_for: Callable[[int], int]):
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.bytes_for = bytes_for  # bytes one row's cache holds at a given length
        self.queue: Deque = deque()
        self.active: Dict[int, object] = {}  # row id -> admitted Row

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
        alive = len(rows)
        for rem in sorted(_remaining(r) for r in rows):
            peak = max(peak, alive * self.bytes_for(base + rem))
            alive -= 1
        return peak

    # -- bookkeeping -------------------------------------------------------------
    def enqueue(self, row) -> None:
        self.queue.append(row)

    def admit(self) -> list:
        """Pop the rows that may start now, in FIFO order (stops at the first misfit)."""
        out = []
        rows = list(self.active.values())
        while self.queue and len(self.active) < self.max_batch:
            row = self.queue[0]
            if (self.kv_budget is not None and rows
                    and self.projected_peak(rows + [row]) > self.kv_budget):
                break
            self.queue.popleft()
            self.active[row.id] = row
            rows.append(row)
            out.append(row)
        return out

    def release(self, row_id: int) -> None:
        self.active.pop(row_id, None)

    def clear(self) -> None:
        """Forget every row (the engine has ended them all)."""
        self.queue.clear()
        self.active.clear()

    def dequeue(self, row) -> bool:
        try:
            self.queue.remove(row)
            return True
        except ValueError:
            return False

