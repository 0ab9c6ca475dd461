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

Verification needs each row's latest token on the host (the drafts follow it), so a
verification step is not pipelined: it first reads the step in flight, which it does
only when some row, not paused (lookup.py), has its last tokens matching earlier
ones (`Speculation.wanted`). It then verifies at the width that gives the most
expected tokens per second -- from each row's acceptance so far and the measured
cost of a step per token fed (`StepCost`) -- unless that width is one.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..messages import Emitted, Updates
from .decoding import HISTORY
from .inflight import InFlight
from .lookup import RowLookup
from .rollback import before_verify, rollback, unsupported_reason

__all__ = ["Speculation", "StepCost", "accept_drafts", "best_width", "MAX_SPEC_BATCH", "MODES"]

MODES = ("lookup",)  # what SamplingParams.speculate takes, besides None
MAX_SPEC_BATCH = 32  # larger batches are bound by the device: extra positions cost


def accept_drafts(toks: mx.array, drafts: mx.array):
    """toks [B, W] sampled at each position, drafts [B, W - 1] (-1: none) ->
    (drafts accepted [B]: the longest prefix equal to the tokens sampled after
    them, the row's next token [B]: the one sampled after that prefix)."""
    match = (toks[:, :-1].astype(mx.int32) == drafts).astype(mx.int32)
    acc = mx.cumprod(match, axis=1).sum(axis=1)
    return acc, mx.take_along_axis(toks, acc[:, None], axis=1)[:, 0]


class StepCost:
    """What a decode step costs as a function of the tokens it feeds (rows x width):
    seconds ~ a + b * tokens, fitted online to decode-only steps (an average per
    token count, then a least-squares line through those). Host-bound steps (a
    small model on a GPU) give b ~ 0: verifying is nearly free; compute-bound ones
    (a CPU, large batches) give a b that makes wide verifications pay only for
    drafts likely to hold. Until two token counts are measured, b is taken as 0."""

    ALPHA = 0.2

    def __init__(self):
        self.mean: Dict[int, float] = {}
        self.ab = None  # (a, b) once fitted
        self.nsteps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.mean.get(tokens)
        self.mean[tokens] = seconds if old is None else old + self.ALPHA * (seconds - old)
        self.nsteps += 1
        if len(self.mean) >= 2:
            xs, ys = list(self.mean), list(self.mean.values())
            mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx_) ** 2 for x in xs)
            b = max(0.0, sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx)
            self.ab = (max(my - b * mx_, 1e-6), b)

    def seconds(self, tokens: int) -> float:
        """A measured token count's own average (step costs jump where kernels
        change, e.g. BLAS at some widths), else the line."""
        seen = self.mean.get(tokens)
        if seen is not None and self.ab is not None:
            return seen
        if self.ab is None:
            return 1.0  # unknown: every width costs the same
        a, b = self.ab
        return a + b * tokens


def expected_accepts(q: float, k: int) -> float:
    """Drafts held of k when each holds with probability q given the ones before."""
    if k <= 0:
        return 0.0
    return q * (1 - q ** k) / (1 - q) if q < 1 else float(k)


def best_width(cost: StepCost, qs: List[float], lens: List[int]) -> int:
    """The verification width (1 = a plain step) with the most expected tokens per
    second for rows whose drafts hold with probabilities `qs` and are `lens` long."""
    B = len(lens)
    best_w, best = 1, B / cost.seconds(B)
    for w in range(2, max(lens) + 2):
        toks = B + sum(expected_accepts(q, min(n, w - 1)) for q, n in zip(qs, lens))
        v = toks / cost.seconds(B * w)
        if v > best:
            best_w, best = w, v
    return best_w


class Speculation:
    """The executor's speculation state: which rows draft, and the verify step."""

    def __init__(self, row_cache: list):
        self.off_reason = unsupported_reason(row_cache)  # None: rows may speculate
        self.cost = StepCost()

    @property
    def facts(self) -> str:
        return self.off_reason or "lookup"

    def attach(self, r, ids: List[int]) -> None:
        """Give a joining row its lookup state if it speculates and can."""
        p = r.params
        if (self.off_reason is None and p.speculate in MODES and not r.processors
                and r.matcher is None):
            r.lookup = RowLookup(ids, p.num_draft)

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A decode-only step of `rows` rows, `width` positions each, took this long."""
        self.cost.observe(rows * width, seconds)

    def wanted(self, ex) -> bool:
        """Worth reading the step in flight now to draft? Some row, not paused, has
        its last tokens matching earlier ones, and the best case (each such row
        drafting its k) would pay; counts down paused rows' pauses."""
        rows = ex._batch_rows
        if len(rows) > MAX_SPEC_BATCH:
            return False
        if ex.inflight is not None and ex.inflight.firsts:
            return False  # a first token to show: keep the plain step (its TTFT)
        qs, ks, fixed = [], [], False
        for r in rows:
            lk = r.lookup
            if lk is not None and not lk.paused() and lk.primed():
                fixed = fixed or lk.fixed  # a user-given num_draft: whatever it costs
                qs.append(lk.q)
                ks.append(lk.k)
                continue
            qs.append(0.0)
            ks.append(0)
        # the best case (every primed row drafts its k) must pay for the read
        return fixed or (any(ks) and best_width(self.cost, qs, ks) > 1)

    def step(self, ex, updates: Updates, emitted: List[Emitted]) -> Optional[tuple]:
        """Verify drafts for this step if that is expected to pay: (drafts proposed,
        accepted, tokens taken, width, seconds it took), else None (the caller
        launches a plain step). Reads the step in flight first."""
        if ex.inflight is not None:
            done, ex.inflight = ex.inflight, None
            ex._read(done, updates, emitted)
        # the read above waited for the previous step's forward: not this step's cost
        t0 = time.perf_counter()
        drafts, qs, drop, forced = [], [], ex.drop, 0
        for r in ex._batch_rows:
            lk = r.lookup
            live = lk is not None and r.id not in drop
            d = lk.draft(r.params.max_tokens - r.launched - 1) if live else []
            if live and not d and lk.was_primed:
                lk.no_draft()
            drafts.append(d)
            qs.append(lk.q if live else 0.0)
            if live and lk.fixed:  # the user's num_draft: verified whatever it costs
                forced = max(forced, len(d))
        if not any(drafts):
            return None
        w = max(best_width(self.cost, qs, [len(d) for d in drafts]), forced + 1)
        if w == 1:
            return None
        out = self._verify(ex, [d[:w - 1] for d in drafts], updates, emitted)
        return out + (time.perf_counter() - t0,)

    def _verify(self, ex, drafts: List[List[int]], updates: Updates,
                emitted: List[Emitted]) -> Tuple[int, int, int, int]:
        rows, ids = ex._batch_rows, list(ex.ids)
        want = ex._want_lp
        W = 1 + max(len(d) for d in drafts)
        padded = mx.array([d + [0] * (W - 1 - len(d)) for d in drafts], dtype=ex.y.dtype)
        inp = mx.concatenate([ex.y[:, None], padded], axis=1)  # [B, W]
        before_verify(ex.caches)
        with ex.adapters.using(ex.adapters.select(ex._row_adapters)):  # each row's LoRA
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
        toks = ex.sampler.sample_wide(full, keep=bool(want))  # [B, W]
        d = mx.array([x + [-1] * (W - 1 - len(x)) for x in drafts], dtype=mx.int32)
        acc, nxt = accept_drafts(toks, d)
        ex.sampler.advance(acc + 1)
        lp = None
        if want:
            flat = [i * W + j for i in want for j in range(W)]
            k = max(rows[i].params.logprobs for i in want)
            idx = mx.array(flat)
            lp = ex.sampler.logprobs(idx, toks.reshape(-1)[idx], k)
            mx.eval(toks, acc, nxt, *[a for a in lp if a is not None])
        else:
            mx.eval(toks, acc, nxt)
        T, A = toks.tolist(), acc.tolist()
        lps = self._logprobs(ex, lp, want, ids, W) if lp is not None else {}
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
            if dr:
                up = updates.of(rid)
                up.draft_proposed += len(dr)
                up.draft_accepted += a
                r.lookup.verified(len(dr), a)
                proposed, accepted = proposed + len(dr), accepted + a
            taken += a + 1
            ex._take(r, T[i][:a + 1], [lps.get((i, j)) for j in range(a + 1)], one,
                     updates, emitted, drafted=a)
        rollback(ex.caches, [W - 1 - a for a in A])
        ex._align()  # new padding, and each row's remaining tokens
        return proposed, accepted, taken, W

    @staticmethod
    def _logprobs(ex, lp, want, ids, W) -> dict:
        chosen = lp.chosen.tolist()
        top_ids = lp.top_ids.tolist() if lp.top_ids is not None else None
        top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
        out = {}
        n = 0
        for i in want:
            k = ex.rows[ids[i]].params.logprobs if ids[i] in ex.rows else 0
            for j in range(W):
                out[(i, j)] = {"logprob": chosen[n],
                               "top": [(t, x) for t, x in zip(top_ids[n][:k], top_lp[n][:k])
                                       if x != -float("inf")] if top_ids else []}
                n += 1
        return out
