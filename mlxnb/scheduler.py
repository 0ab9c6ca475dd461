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
from typing import Callable, Deque, Dict, List, Optional


class _Slot:
    __slots__ = ("row", "length", "remaining")

    def __init__(self, row, length: int, remaining: int):
        self.row, self.length, self.remaining = row, length, remaining


class Scheduler:
    def __init__(self, max_batch: int, kv_budget: Optional[int],
                 bytes_for: Callable[[int], int]):
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.bytes_for = bytes_for  # bytes one row's cache holds at a given length
        self.queue: Deque = deque()
        self.active: Dict[int, _Slot] = {}

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

    def projected_peak(self, slots: List[_Slot]) -> int:
        if not slots:
            return 0
        base = max(s.length for s in slots)
        peak = 0
        alive = len(slots)
        for s in sorted(slots, key=lambda s: s.remaining):
            peak = max(peak, alive * self.bytes_for(base + s.remaining))
            alive -= 1
        return peak

    # -- bookkeeping -------------------------------------------------------------
    def enqueue(self, row) -> None:
        self.queue.append(row)

    def admit(self) -> list:
        """Pop the rows that may start now, in FIFO order (stops at the first misfit)."""
        out = []
        slots = list(self.active.values())
        while self.queue and len(self.active) < self.max_batch:
            row = self.queue[0]
            cand = _Slot(row, row.prompt_tokens, row.params.max_tokens)
            if (self.kv_budget is not None and slots
                    and self.projected_peak(slots + [cand]) > self.kv_budget):
                break
            self.queue.popleft()
            self.active[row.id] = cand
            slots.append(cand)
            out.append(row)
        return out

    def progress(self, row_id: int, new_tokens: int) -> None:
        s = self.active.get(row_id)
        if s is not None:
            s.length += new_tokens
            s.remaining = max(0, s.remaining - new_tokens)

    def progress_many(self, emitted) -> None:
        active = self.active
        for rid, tok, _, _ in emitted:
            s = active.get(rid)
            if s is not None and tok is not None:
                s.length += 1
                s.remaining -= 1

    def release(self, row_id: int) -> None:
        self.active.pop(row_id, None)

    def dequeue(self, row) -> bool:
        try:
            self.queue.remove(row)
            return True
        except ValueError:
            return False


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parse_bytes(v) -> Optional[int]:
    """'2GB', '512MB', 1e9, None -> bytes (None = no limit)."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        if v <= 0:
            raise ValueError(f"kv_budget must be positive, got {v!r}")
        return int(v)
    s = str(v).strip().upper().replace(" ", "")
    if s in ("NONE", "INF", "UNLIMITED"):
        return None
    units = {"TB": 1 << 40, "GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1,
             "T": 1 << 40, "G": 1 << 30, "M": 1 << 20, "K": 1 << 10}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        u, num = "B", s
    try:
        n = float(num)
    except ValueError:
        raise ValueError(f"cannot read {v!r} as a size; write e.g. '2GB' or '512MB'") from None
    if n <= 0:
        raise ValueError(f"kv_budget must be positive, got {v!r}")
    return int(n * units[u])
