"""A row's life as phase records (`Row.trace`) and the queue's reasons for waiting.

The engine notes what only it sees as it happens (why a row waited in the queue, a
prompt-prefix cache hit, each prefill chunk with its step and time, the step a row
ended in) as small tuples on the row; the timestamps the row keeps anyway (submit,
admit, first token, done) give the rest. `phases(row)` turns both into records:

    {"phase": "queued", "t0", "t1", "s", "why": ["batch full" | "KV budget"] or []}
    {"phase": "prefix hit", "t", "tokens"}             prompt tokens reused
    {"phase": "prefill", "t0", "t1", "s", "tokens", "step"}   one per chunk
    {"phase": "first token", "t"}
    {"phase": "decode", "t0", "t1", "s", "tokens", "tok_s"}
    {"phase": "finish", "t", "reason", "step"}

Times are the engine clock (s); an unfinished phase ends at None (t1, s None).
"""

from __future__ import annotations

from typing import List, Optional

BATCH_FULL, KV_BUDGET = "batch full", "KV budget"

# event tuples kept on a row (Row._events)
QUEUE, PREFIX, CHUNK, END = "queue", "prefix", "chunk", "end"


def note_admitted(row, why) -> None:
    row._events.append((QUEUE, tuple(why)))


def note_prefix(row, t: float, tokens: int) -> None:
    row._events.append((PREFIX, t, tokens))


def note_chunk(row, step: int, t_end: float, seconds: float, tokens: int) -> None:
    row._events.append((CHUNK, step, t_end, seconds, tokens))


def note_end(row, step: Optional[int]) -> None:
    row._events.append((END, step))


def _span(phase, t0, t1, **kw) -> dict:
    return {"phase": phase, "t0": t0, "t1": t1,
            "s": None if t1 is None or t0 is None else t1 - t0, **kw}


def phases(row) -> List[dict]:
    """The row's phase records, in time order (see the module docstring)."""
    ev = row._events
    out = [_span("queued", row.t_submit, row.t_admit,
                 why=[w for e in ev if e[0] == QUEUE for w in e[1]])]
    if row.t_admit is None:
        if row.done:  # cancelled or refused in the queue
            out.append({"phase": "finish", "t": row.t_done, "reason": row.finish_reason,
                        "step": None})
        return out
    for e in ev:
        if e[0] == PREFIX:
            out.append({"phase": "prefix hit", "t": e[1], "tokens": e[2]})
    for e in ev:
        if e[0] == CHUNK:
            _, step, t1, secs, n = e
            out.append(_span("prefill", t1 - secs, t1, tokens=n, step=step))
    if row.t_first is not None:
        out.append({"phase": "first token", "t": row.t_first})
        out.append(_span("decode", row.t_first, row.t_done, tokens=max(0, row.ntok - 1),
                         tok_s=row.tok_s))
    if row.done:
        step = next((e[1] for e in ev if e[0] == END), None)
        out.append({"phase": "finish", "t": row.t_done, "reason": row.finish_reason,
                    "step": step})
    return out


def durations(row) -> dict:
    """queue_s, prefill_s (admitted to first token), decode_s (first token to done)."""
    def d(a, b):
        return None if a is None or b is None else b - a
    return {"queue_s": d(row.t_submit, row.t_admit), "prefill_s": d(row.t_admit, row.t_first),
            "decode_s": d(row.t_first, row.t_done)}
