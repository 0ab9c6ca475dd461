"""Draft-model speculation inside the running batch (worker thread).

Rows that speculate with `speculate="draft"` form the draft batch: a batch cache of
the draft model, one row per such batch row, holding that row's tokens except its
last (its next input). Before a verification step the draft proposes for every
drafting row in one batched forward per draft position (k forwards for the
longest draft k); speculate.py verifies all rows' drafts in one target forward;
then each row's draft cache keeps the positions its row accepted and gives back the
rest (rollback.py, the same per-row rollback as the target's). A row whose every
draft was kept needs its last draft in the cache too: one more draft forward feeds
it to all rows (the others roll it back).

Each row's schedule is its own (`DraftRow`): how many tokens it drafts depends only
on what it got accepted, never on the batch or on timings, so a seeded row draws
the same tokens alone or in any batch (draftrule.py), and whenever one of its
drafts is due the step verifies it. A row whose drafts keep failing (acceptance
collapsed: a useless draft) leaves the draft batch for the rest of its life and
decodes plainly; its cost was a few probes.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .caches import aligned_views, layer_costs, left_padded, make_row_cache, merge_lean
from .draftrule import draft_draw, reject_sample, vocab_keys
from .rollback import rollback, unsupported_reason
from .sampling import MIN_TEMPERATURE
from .specpolicy import RowPolicy
from .wideattn import wide_attention
from .tokens import ids

__all__ = ["DraftRow", "DraftSource", "DEFAULT_K", "MAX_K", "FAILS_OFF", "LOW_RATE"]

# The adaptive draft length starts at one draft (a probe of an unknown draft feeds the
# model two positions, not five: on a compute-bound device the probes of a useless
# draft cost a plain step or so) and doubles while every draft holds.
DEFAULT_K = 1
MAX_K = 8
FAILS_OFF = 2  # consecutive verifications with nothing kept: acceptance collapsed
LOW_RATE, LOW_AFTER = 0.15, 8  # or a decayed acceptance this low after this many
PREFILL_CHUNK = 512  # prompt tokens per draft prefill forward


class DraftRow(RowPolicy):
    """One row's draft length and on/off state (its RowPolicy, specpolicy.py, with a
    schedule of its own: no pauses, no cost model; off for good once its
    acceptance collapses)."""

    def __init__(self, num_draft: int, n_ids: int):
        super().__init__(num_draft)
        self.user_k = num_draft > 0  # a user-given k: kept, and never switched off
        self.fixed = True  # its drafts are verified whenever due
        self.k = num_draft if self.user_k else DEFAULT_K
        self.k_max = num_draft if self.user_k else MAX_K
        self._off: Optional[str] = None  # why it stopped drafting
        self.verifications = 0
        self.seq_len = n_ids  # the row's tokens: prompt + taken
        self.fed = n_ids - 1  # of which the draft cache holds these
        self.stash: List[int] = []  # this step's proposal

    @property
    def off(self) -> Optional[str]:
        return self._off

    @off.setter
    def off(self, why: Optional[str]) -> None:
        self._off = why
        self.pause = 0 if why is None else 1 << 30  # the verifier skips paused rows

    def extend(self, toks) -> None:
        self.seq_len += len(toks)

    def ready(self) -> bool:
        return self._off is None

    def paused(self) -> bool:
        return self._off is not None

    def verified(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        self._held = 0.8 * self._held + accepted
        self._missed = 0.8 * self._missed + (accepted < proposed)
        self.fails = self.fails + 1 if accepted == 0 else 0
        if not self.user_k:
            self.k = (min(2 * self.k, self.k_max) if accepted == proposed
                      else max(1, min(accepted + 1, self.k_max)))
            if self.fails >= FAILS_OFF:
                self.off = "acceptance collapsed"
            elif self.verifications >= LOW_AFTER and self.q < LOW_RATE:
                self.off = "acceptance too low to pay"


class DraftSource:
    """The draft model's batch: membership, proposals, and their rollback. A draft
    source of speculate.py's (`mode`, `attach`, `propose`), with the executor at
    hand: it drafts from each row's next input on the device and its sampler's
    keys."""

    mode = "draft"

    def __init__(self, model, name: str, ex=None):
        self.model, self.name, self.ex = model, name, ex
        probe = self._row_cache()
        why = unsupported_reason(probe)
        if why is not None:
            raise ValueError(f"the draft model cannot speculate: its {why[5:]}; use a "
                             f"draft with attention layers only")
        # what a row's draft cache holds per token, read off a 1-token forward: the
        # engine's kv_budget counts it for every row (any row may draft), so
        # admission leaves room for the draft batch's KV as for the target's
        try:  # a layers:N draft of a family that indexes layers from outside the list
            model(ids([[0]]), cache=probe)  # (a hybrid's first full-attention layer)
            mx.eval([c.state for c in probe])
        except Exception as e:
            raise ValueError(f"the draft model {name} does not run on its own "
                             f"({type(e).__name__}: {e}); pass another draft model"
                             + (" or another N" if name.startswith("layers:") else "")
                             ) from None
        self.kv_costs = layer_costs(probe)
        self.ids: List[int] = []  # row ids, draft batch order
        self.rows: Dict[int, DraftRow] = {}
        self.caches: Optional[list] = None
        self._keys = None  # the noise's per-token keys
        self._written = 0  # positions the last proposal wrote per row
        self._last = None  # [D] its last draft tokens (for the catch-up forward)
        self._logq = None  # [D, K, V] what drawing rows' drafts were drawn from
        self._tokens = None  # [D, K]
        self._k: List[int] = []  # each row's drafts this step
        self._drawing: List[bool] = []  # each row draws (temperature > 0)
        self.proposed = self.accepted = 0  # totals over rows (status)

    def _row_cache(self) -> list:
        """A row's draft cache: sliding-window layers keep every position (their mask
        still applies the window), so rejected drafts roll back like any other; the
        draft is small next to the target, and so is that KV."""
        return [KVCache() if type(c) is RotatingKVCache and c.keep == 0 else c
                for c in make_row_cache(self.model)]

    @classmethod
    def build(cls, draft, model, tokenizer, ex=None) -> Optional["DraftSource"]:
        """The draft source for `Engine(draft_model=draft)` (None: no draft)."""
        if draft is None:
            return None
        from ...models.draft import build_draft

        def out_dim(m) -> int:
            return int(m(ids([[0]]), cache=make_row_cache(m)).shape[-1])

        dm, name = build_draft(draft, model, tokenizer, out_dim)
        return cls(dm, name, ex)

    # -- membership --------------------------------------------------------------
    def attach(self, r, ids: List[int]) -> DraftRow:
        """A joining row's draft state; its prompt (all but the last token, which is
        its next input) is prefilled into a draft cache that joins the batch."""
        lk = DraftRow(r.params.num_draft, len(ids))
        if len(ids) < 2:
            lk.off = "a one-token prompt"
            return lk
        cache = self._prefill(ids[:-1])
        batch = merge_lean([[c] for c in cache])
        if self.caches is None:
            self.caches = batch
        else:
            for c, n in zip(self.caches, batch):
                c.extend(n)
        self.ids.append(r.id)
        self.rows[r.id] = lk
        return lk

    def _prefill(self, head: List[int]) -> list:
        """A row cache holding `head`. Only the KV is wanted: mlx-lm's decoder body
        (`model.model`) runs without the output head where the model has one (the
        head's [L, vocab] logits would cost more than a small draft's layers). Its
        attention is composed from plain ops (wideattn.py): every prompt length is a
        new shape, which some backends prepare per shape at great cost."""
        body = getattr(self.model, "model", None)
        for run in ((body,) if callable(body) else ()) + (self.model,):
            cache = self._row_cache()
            try:
                for i in range(0, len(head), PREFILL_CHUNK):
                    with wide_attention():
                        run(ids([head[i:i + PREFILL_CHUNK]]), cache=cache)
                    mx.eval([c.state for c in cache])
                return cache
            except TypeError:  # a body that takes other arguments: the whole model
                if run is self.model:
                    raise
        raise AssertionError("unreachable")

    def _sync(self, ex) -> Dict[int, int]:
        """Keep the rows still decoding and drafting; -> {row id: target position}."""
        pos = {rid: i for i, rid in enumerate(ex.ids)}
        keep = []
        for j, rid in enumerate(self.ids):
            lk = self.rows[rid]
            if lk.off is None and lk.fed != lk.seq_len - 1:
                lk.off = "missed a step"  # (only a row's last token is decoded plainly)
            if rid in pos and rid not in ex.drop and lk.off is None:
                keep.append(j)
        if len(keep) < len(self.ids):
            for rid in [self.ids[j] for j in range(len(self.ids)) if j not in set(keep)]:
                self.rows.pop(rid, None)
            self.ids = [self.ids[j] for j in keep]
            if not keep:
                self.caches = None
            else:
                idx = ids(keep)
                for c in self.caches:
                    c.filter(idx)
        return pos

    def wanted(self, ex) -> bool:
        """Is a draft due for some row? (Then this step verifies.) Rows that left
        or stopped drafting leave the draft batch here when none is due: their KV
        goes at once, not at the next draft."""
        due = stale = False
        for rid in self.ids:
            r, lk = ex.rows.get(rid), self.rows[rid]
            if r is None or lk.off is not None or rid in ex.drop:
                stale = True
            elif r.params.max_tokens - r.launched > 1:
                due = True
        if stale and not due:
            self._sync(ex)
        return due

    # -- a step ------------------------------------------------------------------
    def propose(self, rows, limits: List[int], after=None) -> List[List[int]]:
        """Up to limits[i] drafts for each of `rows` (this source's RowDecoders,
        drafting this step), following the tokens each has taken (`after` is always
        empty: draft rows verify drained). Every row of the draft batch is drafted
        for in the same forwards (k of them for the longest k; the others' extra
        positions roll back). A draft that fails stops drafting (its rows decode
        plainly), nothing more."""
        want = {r.id: max(0, n) for r, n in zip(rows, limits)}
        try:
            self._propose(self.ex, want)
        except Exception as e:
            self.reset(f"the draft failed: {type(e).__name__}: {e}")
        return [self.rows[r.id].stash if r.id in self.rows else [] for r in rows]

    def _propose(self, ex, want: Dict[int, int]) -> bool:
        pos = self._sync(ex)
        self._written = 0
        for lk in self.rows.values():
            lk.stash = []
        if not self.ids:
            return False
        rows = [ex.rows[rid] for rid in self.ids]
        ks = [want.get(r.id, 0) for r in rows]
        K = max(ks)
        if K == 0:
            return False
        idx = ids([pos[rid] for rid in self.ids])
        temps, seeds, counters = ex.sampler.row_keys(idx)
        drawing = [r.params.temperature >= MIN_TEMPERATURE and r.params.top_k != 1
                   for r in rows]
        sampled = any(drawing)
        groups: Dict[tuple, List[int]] = {}
        for i, (r, d) in enumerate(zip(rows, drawing)):
            if d and r.params.filters != (0, 1.0, 0.0):
                groups.setdefault(r.params.filters, []).append(i)
        groups = {f: (ids(ix), len(ix)) for f, ix in groups.items()}
        views = self.caches if left_padded(self.caches) else aligned_views(self.caches)
        y = ex.y[idx]  # [D] each row's next input
        toks, logqs = [], []
        for j in range(K):
            logits = self.model(y[:, None], cache=views)[:, -1, :]  # [D, V]
            if self._keys is None or self._keys.shape[0] != logits.shape[-1]:
                self._keys = vocab_keys(logits.shape[-1])
            y, logq = draft_draw(logits, temps, groups, seeds, counters + j, self._keys,
                                 sampled)
            toks.append(y)
            logqs.append(logq)
        self._tokens = mx.stack(toks, axis=1)  # [D, K]
        self._logq = mx.stack(logqs, axis=1) if sampled else None  # [D, K, V]
        self._last = y
        mx.eval(self._tokens, *([self._logq] if sampled else []))
        T = self._tokens.tolist()
        self._written, self._k = K, ks
        self._drawing = drawing
        for i, rid in enumerate(self.ids):
            self.rows[rid].stash = T[i][:ks[i]]
        return True

    @property
    def judging(self) -> bool:
        """Does this step's verification apply the rejection rule to some row?"""
        return bool(self._written and self._logq is not None
                    and any(d and k for d, k in zip(self._drawing, self._k)))

    def judge(self, ex, toks: mx.array, drafts: mx.array, acc: mx.array, nxt: mx.array):
        """Apply the rejection rule to drawing draft rows. toks [B, W] the target's
        draws, drafts [B, W - 1] (-1: none), acc [B], nxt [B] from the argmax rule.
        -> (toks, acc, nxt) with those rows' kept drafts and next token."""
        if not self._written or self._logq is None:
            return toks, acc, nxt
        sel = [i for i, d in enumerate(self._drawing) if d and self._k[i]]
        if not sel:
            return toks, acc, nxt
        pos = {rid: i for i, rid in enumerate(ex.ids)}
        tgt = [pos[self.ids[i]] for i in sel]
        B, W = toks.shape
        K = min(self._written, W - 1)
        s = ex.sampler
        x, temp = s.drawn_from()  # [B * W, V] filtered logits, [B * W] temperatures
        V = x.shape[-1]
        ti = ids(tgt)
        z = x.reshape(B, W, V)[ti][:, :K, :].astype(mx.float32)
        t = temp.reshape(B, W)[ti][:, :K]
        z = z / mx.where(t > 0, t, 1.0)[..., None]
        logp = z - mx.logsumexp(z, axis=-1, keepdims=True)  # [S, K, V]
        di = ids(sel)
        logq = self._logq[di][:, :K, :]
        k = mx.array([min(self._k[i], K) for i in sel])
        d = drafts[ti][:, :K]
        bonus = mx.take_along_axis(toks[ti], k[:, None], axis=1)[:, 0]
        _, seeds, counters = s.row_keys(ti)
        a, n = reject_sample(logp, logq, d, k, bonus, seeds, counters, self._keys)
        acc, nxt = mx.array(acc), mx.array(nxt)
        acc[ti] = a
        nxt[ti] = n.astype(nxt.dtype)
        # the row's tokens this step: its kept drafts, then the next token
        j = mx.arange(W)[None, :]
        dpad = mx.concatenate([d, mx.zeros((len(sel), W - K), d.dtype)], axis=1)
        row = mx.where(j < a[:, None], dpad, mx.where(j == a[:, None], n[:, None], 0))
        toks = mx.array(toks)
        toks[ti] = row.astype(toks.dtype)
        return toks, acc, nxt

    def verified(self, ids: List[int], accepted: List[int]) -> None:
        """After the target's verification: accepted[i] drafts kept by target row
        ids[i]. Each draft row's cache keeps its input and its kept drafts."""
        try:
            self._verified(ids, accepted)
        except Exception as e:
            self.reset(f"the draft failed: {type(e).__name__}: {e}")

    def _verified(self, ids: List[int], accepted: List[int]) -> None:
        K = self._written
        if not K or not self.ids:
            return
        pos = {rid: i for i, rid in enumerate(ids)}
        keep = [min(accepted[pos[rid]], self._k[i]) if rid in pos else 0
                for i, rid in enumerate(self.ids)]
        written = K
        if max(keep) == K:  # its last draft is not in the cache yet: feed it to all
            views = self.caches if left_padded(self.caches) else aligned_views(self.caches)
            self.model(self._last[:, None], cache=views)
            written += 1
        rollback(self.caches, [written - 1 - a for a in keep])
        for rid, a, kk in zip(self.ids, keep, self._k):
            lk = self.rows[rid]
            lk.fed += 1 + a
            if kk:
                self.proposed += kk
                self.accepted += a
        self._written = 0
        self._logq = None

    def reset(self, why: str) -> None:
        """Every row stops drafting (`why`), and the draft batch is freed."""
        for lk in self.rows.values():
            lk.stash = []
            lk.off = lk.off or why
        self.ids, self.rows, self.caches = [], {}, None
        self._written, self._logq = 0, None

    @property
    def facts(self) -> str:
        return f"draft {self.name}"
