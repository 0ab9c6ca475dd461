"""Pipelined verification: a verification step launched like a plain decode step,
read back a step later, so the host builds step N+1 while the device computes N.

The step feeds every row [its next input, as the step before computes it, + its
drafts] ([B, W]), samples each position (sampling.py `sample_wide`), and counts on
the device each row's accepted drafts (verify.py `accept_drafts`) and its next
input. Nothing on the host waits for them: the rejected positions leave the cache
by a roll whose shift is that device count (rollback.py `roll_lazy`: they become
left padding), the sampler's counters move by it, and the host reads the tokens
one step later, like a plain step's. Its drafts were proposed from the tokens the
host had read, one or two steps behind (speculate.py): they are checked against
what the model computes after the row's real tokens, so they are exact whatever
the host guessed.

Rejected positions padded on the left cost attention over them (and a batch with
any padding takes masks and per-row offsets) until they are trimmed: once no
verification is in flight (the padding is computed: reading it waits for nothing),
and once `TRIM_AT` of them may have gathered (then a launch reads the padding,
waiting for the step in flight).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .._trace import lap, pc
from .caches import LeanBatchKVCache, aligned_views, leaves
from .inflight import InFlight
from .rollback import roll_lazy
from .verify import accept_drafts
from .wideattn import wide_attention

__all__ = ["flat_only", "launch_wide", "read_wide", "trim", "TRIM_AT"]

TRIM_AT = 64  # positions of padding the rows may have gathered before a trim


def flat_only(row_cache: list) -> bool:
    """Can this model's batch caches roll back without the host (plain KV only)?"""
    return all(type(c) is KVCache for c in leaves(row_cache))


def trim(ex) -> None:
    """Drop the left padding every row of the batch has (a read of the padding:
    a wait for the step in flight if that is a verification); a batch left with
    none goes back to the plain views (caches.py `aligned_views`)."""
    ex.spec.slack = 0
    cs = [c for c in leaves(ex.caches) if isinstance(c, LeanBatchKVCache)]
    if not cs or cs[0].keys is None:
        return
    pads = cs[0].left_padding.tolist()
    m = min(pads)
    if max(pads) == m:
        ex.views = aligned_views(ex.caches)
    if m <= 0:
        return
    ex.spec.trims += 1
    for c in cs:
        i = c._idx
        c.keys[..., :i - m, :] = c.keys[..., m:i, :]
        c.values[..., :i - m, :] = c.values[..., m:i, :]
        c._idx = i - m
        c.left_padding = c.left_padding - m


def launch_wide(ex, drafts: List[List[int]]) -> InFlight:
    """Launch a verification of `drafts` (per batch row; [] none) without waiting."""
    spec = ex.spec
    tr = ex.tracer
    t = pc() if tr else 0.0
    if spec.slack >= TRIM_AT:
        trim(ex)
    W = 1 + max(len(d) for d in drafts)
    padded = mx.array([d + [0] * (W - 1 - len(d)) for d in drafts], dtype=ex.y.dtype)
    inp = mx.concatenate([ex.y[:, None], padded], axis=1)  # [B, W]
    # each row's LoRA; attention without per-shape setup (wideattn.py)
    with ex.adapters.using(ex.adapters.select(ex._row_adapters)), wide_attention():
        full = ex.model(inp, cache=ex.views)  # [B, W, V]
    if ex.sampler.needs_float32:
        full = full.astype(mx.float32)
    if tr:
        t = lap(tr, "wide.fwd_build", t)
    toks = ex.sampler.sample_wide(full, keep=False)  # [B, W]
    d = mx.array([x + [-1] * (W - 1 - len(x)) for x in drafts], dtype=mx.int32)
    acc, nxt = accept_drafts(toks, d)  # [B], [B]
    ex.sampler.advance(acc + 1)
    roll_lazy(ex.caches, (W - 1) - acc)
    spec.slack += W - 1
    ex.views = ex.caches  # rows may be padded now: masks and per-row offsets
    if tr:
        t = lap(tr, "wide.sample_roll", t)
    mx.async_eval(toks, acc)
    if tr:
        lap(tr, "wide.async_eval", t)
        tr("n.width", W)
    for r in ex._batch_rows:
        r.launched += 1  # and what it accepted, once read
    ex._headroom -= 1
    ex.y = nxt
    return InFlight(list(ex.ids), toks, accepted=acc,
                    drafts={rid: dr for rid, dr in zip(ex.ids, drafts) if dr})


def read_wide(ex, inflight: InFlight, updates, emitted) -> tuple:
    """Read a pipelined verification back: each row takes its tokens. Returns
    (drafts proposed, accepted) of the rows still running, (width, tokens taken)."""
    tr = ex.tracer
    t = pc() if tr else 0.0
    T, A = inflight.tokens.tolist(), inflight.accepted.tolist()
    if tr:
        t = lap(tr, "wide.read_wait", t)
    proposed = accepted = 0
    rows, drop = ex.rows, ex.drop
    for i, rid in enumerate(inflight.row_ids):
        r = rows.get(rid)
        if r is None:
            continue
        a = A[i]
        r.launched += a
        if rid in drop:
            continue
        dr = inflight.drafts.get(rid)
        toks = T[i][:a + 1]
        took = ex._take(r, toks, [None] * (a + 1), inflight, updates, emitted, drafted=a)
        if dr:
            r.spec.stale = a < len(dr)
            n, kept = ex._drafts_taken(r, dr, a, toks, took, updates)
            proposed, accepted = proposed + n, accepted + kept
    if tr:
        lap(tr, "wide.take", t)
    return (proposed, accepted), (len(T[0]), len(A) + sum(A))
