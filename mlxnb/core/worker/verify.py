"""A verification read back at once (speculate.py's `step`): the batch's drafts checked
in one target forward [B, W], each row's accepted prefix and next token decided on
the device (`accept_drafts`), then read, taken row by row, and the rejected
positions rolled out of the cache on the host (rollback.py). The pipelined way
(wide.py) uses the same acceptance without the read.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from .._trace import lap, pc
from ..messages import Emitted, Updates
from .decoding import HISTORY
from .inflight import InFlight
from .rollback import before_verify, rollback
from .wideattn import wide_attention

__all__ = ["accept_drafts", "verify"]


def accept_drafts(toks: mx.array, drafts: mx.array):
    """toks [B, W] sampled at each position, drafts [B, W - 1] (-1: none) ->
    (drafts accepted [B]: the longest prefix equal to the tokens sampled after
    them, the row's next token [B]: the one sampled after that prefix)."""
    match = (toks[:, :-1].astype(mx.int32) == drafts).astype(mx.int32)
    acc = mx.cumprod(match, axis=1).sum(axis=1)
    return acc, mx.take_along_axis(toks, acc[:, None], axis=1)[:, 0]


def verify(ex, drafts: List[List[int]], done: Optional[InFlight], draft, updates: Updates,
           emitted: List[Emitted]) -> Tuple[int, int, int, int]:
    """Verify `drafts` (per batch row; [] none) in one forward and read it back at once:
    each row takes its accepted drafts and the token after them, the rest leave the
    cache. `done`: the plain step in flight, read while this one computes (None: read
    already). `draft`: the draft model's source (draft.py), or None. Returns (drafts
    proposed, accepted, tokens taken, width)."""
    rows, ids = ex._batch_rows, list(ex.ids)
    want = ex._want_lp
    tr = ex.tracer
    t = pc() if tr else 0.0
    W = 1 + max(len(d) for d in drafts)
    padded = mx.array([d + [0] * (W - 1 - len(d)) for d in drafts], dtype=ex.y.dtype)
    inp = mx.concatenate([ex.y[:, None], padded], axis=1)  # [B, W]
    before_verify(ex.caches)
    # each row's LoRA; attention without per-shape setup (wideattn.py)
    with ex.adapters.using(ex.adapters.select(ex._row_adapters)), wide_attention():
        full = ex.model(inp, cache=ex.views)  # [B, W, V]
    if want or ex._any_procs or ex.sampler.needs_float32:
        full = full.astype(mx.float32)
    if ex._any_procs or ex._any_constrained:  # such rows take position 0 only
        first = full[:, 0, :]
        if ex._any_procs:
            first = ex._process(rows, first, updates)
        if ex._any_constrained:
            ex.masks.start(None, ex.rows, rows)
            first = ex.masks.apply(first)
        full = mx.concatenate([first[:, None], full[:, 1:]], axis=1)
    if tr:
        t = lap(tr, "verify.fwd_build", t)
    judged = draft is not None and draft.judging
    toks = ex.sampler.sample_wide(full, keep=bool(want) or judged)  # [B, W]
    d = mx.array([x + [-1] * (W - 1 - len(x)) for x in drafts], dtype=mx.int32)
    acc, nxt = accept_drafts(toks, d)
    if judged:  # drawing draft rows: the rejection rule (draftrule.py)
        toks, acc, nxt = draft.judge(ex, toks, d, acc, nxt)
    ex.sampler.advance(acc + 1)
    lp = None
    outs = [toks, acc, nxt]
    if want:
        flat = [i * W + j for i in want for j in range(W)]
        k = max(rows[i].params.logprobs for i in want)
        idx = mx.array(flat)
        lp = ex.sampler.logprobs(idx, toks.reshape(-1)[idx], k)
        outs += [a for a in lp if a is not None]
    if tr:
        t = lap(tr, "verify.sample", t)
    if done is not None:  # read the step in flight while this one computes
        mx.async_eval(*outs)
        ex._read(done, updates, emitted)
        if tr:
            t = lap(tr, "verify.read_inflight", t)
    mx.eval(*outs)
    T, A = toks.tolist(), acc.tolist()
    if tr:
        t = lap(tr, "verify.wait", t)
    lps = _logprobs(ex, lp, want, ids, W) if lp is not None else {}
    ex.y = nxt
    proposed = accepted = taken = 0
    one = InFlight(ids, nxt)  # what constrained rows' matchers read
    for i, (rid, r, dr) in enumerate(zip(ids, rows, drafts)):
        a = A[i]
        r.launched += a + 1
        if r.processors:
            r.history = mx.concatenate([r.history[-HISTORY + 1:], nxt[i:i + 1]])
        if rid in ex.drop or ex.rows.get(rid) is None:
            continue
        taken += a + 1
        toks = T[i][:a + 1]
        took = ex._take(r, toks, [lps.get((i, j)) for j in range(a + 1)], one, updates,
                        emitted, drafted=a)
        if dr:
            n, kept = ex._drafts_taken(r, dr, a, toks, took, updates)
            proposed, accepted = proposed + n, accepted + kept
    if tr:
        t = lap(tr, "verify.take", t)
    rollback(ex.caches, [W - 1 - a for a in A])
    if draft is not None:
        draft.verified(ids, A)
    if tr:
        t = lap(tr, "verify.rollback", t)
    ex._align()  # new padding, and each row's remaining tokens
    if tr:
        lap(tr, "verify.align", t)
        tr("n.width", W)
    return proposed, accepted, taken, W

def _logprobs(ex, lp, want, ids, W) -> dict:
    chosen = lp.chosen.tolist()
    top_ids = lp.top_ids.tolist() if lp.top_ids is not None else None
    top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
    # a constrained row takes position 0 only, masked as in a plain step
    allowed = ex.masks.allowed if ex._any_constrained else {}
    out = {}
    n = 0
    for i in want:
        k = ex.rows[ids[i]].params.logprobs if ids[i] in ex.rows else 0
        for j in range(W):
            out[(i, j)] = {"logprob": chosen[n],
                           "top": [(t, x) for t, x in zip(top_ids[n][:k], top_lp[n][:k])
                                   if x != -float("inf")] if top_ids else []}
            if j == 0 and i in allowed:
                out[(i, j)]["allowed"] = allowed[i]
            n += 1
    return out
