"""MLX batch execution: everything here runs on the engine's one worker thread.

One `tick` = apply cancellations, drop finished rows from the batch, join rows whose
prefill is complete, launch decode step N+1, prefill up to one chunk, then read step
N's tokens (so the device computes N+1 while the host reads N), detokenize and check
stops. With nothing to prefill or finish, a tick may run a streak of such decode
steps before it returns, until the loop side has news (new rows, cancels) or a
joined row's first token is read. The loop thread gets back plain Python values
(`TickReport`).

Admitted rows prefill in groups (prefill.py: a `Prefill` the executor owns);
a done group's cache joins the running left-padded batch cache (caches.py: every
cache kind mlx-lm's models make, in any per-layer mix) and each row's last prompt
token is its first decode input. When no row is padded the model sees plain-KVCache
views of its KV layers: no mask array, scalar RoPE offsets.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..constrain import Constraints, verdict
from .masks import MaskFiller
from .decoding import HISTORY, RowDecoder
from .fuse import fuse_projections
from . import caches
from .._trace import lap, pc, timed
from .caches import aligned_views, left_padded
from .prefill import (AUTO_MAX, IDLE_PREFILL, Prefill, PrefillPolicy, ShapeMemory,
                      padding_stays_out)
from .prefix import PrefixStore
from ..rows import SamplingParams
from .sampling import BatchSampler, top_logprobs

@dataclass
class Admit:
    row_id: int
    ids: List[int]
    params: SamplingParams


@dataclass
class RowUpdate:
    row_id: int
    state: Optional[str] = None  # 'prefill' | 'decode'
    prefill_done: Optional[int] = None
    cached_tokens: Optional[int] = None
    finish: Optional[str] = None
    error: Optional[str] = None
    # A constrained row's output judged here from its matcher (checked): why it falls
    # short of the constraint, or None. Unchecked: the loop checks the text itself.
    checked: bool = False
    constraint_error: Optional[str] = None


@dataclass
class TickReport:
    updates: Dict[int, RowUpdate]  # state changes, prefill progress, finishes
    emitted: List[tuple]  # (row id, token or None, new text, logprob or None)
    steps: List["StepStat"]  # one per decode step taken in this tick
    busy: bool  # more work pending inside the executor


@dataclass
class StepStat:
    decoded: int  # rows in the decode step launched
    prefill_tokens: int
    read: int  # tokens read back
    seconds: float
    kv_bytes: int
    batch_ids: tuple  # rows in the decode batch, each holding `batch_share` bytes
    batch_share: int
    prefill_bytes: Dict[int, int]


class BatchExecutor:
    def __init__(self, model, tokenizer, prefill_chunk: Optional[int] = None,
                 prefix_bytes: int = 0, fuse: bool = False,
                 kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 fill_threads: Optional[int] = None):
        self.model, self.tokenizer = model, tokenizer
        self.tracer = None  # see trace()
        self.prefill_chunk = prefill_chunk  # None: auto (PrefillPolicy)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.quantized_attention = True  # (caches._Quantized; _probe_costs may clear it)
        self.eos = set(tokenizer.eos_token_ids or ())
        probe = self.make_cache()
        bad = caches.unsupported(probe)
        if bad:
            raise ValueError(
                f"mlxnb cannot batch this model: its {', '.join(bad)} cache has no "
                f"batched form (mlxnb batches KVCache, RotatingKVCache, ArraysCache, "
                f"CacheList and quantized KV). Use mlx_lm.generate for it.")
        self.layer_costs = self._probe_costs()
        # fuse.py: in place, same outputs; its probe is a fresh 1-token forward
        self.fused = fuse_projections(model, lambda: model(
            mx.array([[0]]), cache=self.make_cache())) if fuse else 0
        pad_safe = padding_stays_out(model, self.make_cache, self._probe_ids())
        self.cache_kinds = caches.describe(probe, kv_bits, self.quantized_attention)
        # prefix entries are slices of full-attention KV (quantized or not): windows
        # and recurrent states would need a snapshot at the prefix boundary instead
        self.prefix_bytes = prefix_bytes
        self.prefix = PrefixStore(prefix_bytes, self.make_cache) if (
            prefix_bytes and PrefixStore.supports(probe)) else None
        self.shapes = ShapeMemory()
        self.policy = PrefillPolicy(prefill_chunk)
        self.prefill = Prefill(model, self.make_cache, self.policy, self.shapes, self.prefix)
        self.prefill.pad_safe = pad_safe
        self._cold_launch = False  # a new decode batch shape (set by _align), this tick
        self.constraints = Constraints(tokenizer)  # constrain.py: per-row grammars
        self.masks = MaskFiller(self.constraints, fill_threads)  # masks.py
        self._reset_batch()
        self.nsteps = 0

    def trace(self, tracer) -> None:
        """Report each tick's parts to `tracer(name, seconds)` (_trace.py); None: off."""
        self.tracer = self.prefill.tracer = self.masks.tracer = tracer

    def _probe_ids(self) -> List[int]:
        """Token ids of ordinary text, for probe forwards (any ids if the tokenizer
        cannot encode it)."""
        try:
            return [int(t) for t in self.tokenizer.encode(
                "The quick brown fox jumps over the lazy dog, again and again.")]
        except Exception:
            return []

    def make_cache(self) -> list:
        """A fresh single-row cache of this engine's kinds (KV quantized if asked)."""
        return caches.make_row_cache(self.model, self.kv_bits, self.kv_group_size,
                                     self.quantized_attention)

    def _probe_costs(self) -> List[tuple]:
        """caches.layer_costs of a real forward (a token, a chunk, a decode step).
        With kv_bits, attention reads the quantized KV directly if the device can
        (mx.quantized_matmul at these shapes), else dequantized."""
        def run():
            cache = self.make_cache()
            for n in (1, 5, 1):
                self.model(mx.zeros((1, n), mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            return cache

        try:
            return caches.layer_costs(run())
        except Exception:
            if self.kv_bits is None:
                raise
        self.quantized_attention = False
        try:
            return caches.layer_costs(run())
        except Exception as e:
            raise ValueError(
                f"this model cannot run with a quantized KV cache (kv_bits="
                f"{self.kv_bits}, kv_group_size={self.kv_group_size}) on this device: "
                f"{' '.join(str(e).split())[:160]} Use a kv_group_size that divides its "
                f"head dim, or no kv_bits.") from None

    def kv_bytes_for(self, length: int) -> int:
        """Most bytes a row's caches can allocate while it holds `length` tokens."""
        # Caches grow in 255/256-token steps from wherever they stand; merges,
        # prefix hits, batch filters and chunks that change size from tick to tick
        # (the idle budget follows a measured rate) leave them at unaligned sizes.
        # A growth that trims to the used length leaves < 256 spare slots, one that
        # doesn't keeps those and adds < 256 more, so n tokens take < n + 512 slots.
        # A sliding window holds window - 1 + chunk tokens while prefilling; a
        # recurrent state is the same size at any length.
        alloc = max(length, 1) + 512
        win = max(self.prefill_chunk or 0, IDLE_PREFILL, AUTO_MAX)
        return sum(fixed + per_tok * (min(alloc, w + win) if w else alloc)
                   for per_tok, w, fixed in self.layer_costs)

    def _reset_batch(self):
        self.ids: List[int] = []  # row ids in batch order
        self.rows: Dict[int, RowDecoder] = {}
        self.caches: Optional[list] = None
        self.views: Optional[list] = None  # what the model sees: caches or aligned views
        self.y: Optional[mx.array] = None  # [B] next input tokens
        self.sampler = BatchSampler()
        self.inflight = None  # (row ids, tokens [B], logprob arrays) of the last launch
        self._inflight_firsts = False  # it carries a joined row's first token
        self.drop: set = set()
        self._batch_rows, self._want_lp, self._any_procs, self._headroom = [], [], False, 0
        self._ids_tuple: tuple = ()  # self.ids, shared by step records until it changes
        self._any_constrained = False
        self.masks.reset()

    @property
    def busy(self) -> bool:
        return bool(self.prefill.busy or self.ids or self.inflight)

    # -- the tick ----------------------------------------------------------------
    def tick(self, admits: List[Admit], cancels: List[int], streak_s: float = 0.0,
             interrupt: Optional[threading.Event] = None) -> TickReport:
        """One scheduler iteration. With `streak_s` > 0 and nothing to prefill or
        finish, keep decoding further steps for up to that long before returning:
        each return trip through the event loop costs host time the device waits for.
        A streak also ends once `interrupt` is set (new rows or cancels on the loop
        side) and right after a joined row's first token is read (its TTFT)."""
        up: Dict[int, RowUpdate] = {}

        def u(rid) -> RowUpdate:
            return up.setdefault(rid, RowUpdate(rid))

        emitted: List[tuple] = []
        for rid in cancels:
            self._cancel(rid, u, emitted)
        self.prefill.waiting.extend(admits)
        steps: List[StepStat] = []
        t0 = t = time.perf_counter()
        while True:
            self._filter()
            n_read = len(emitted)
            joining = bool(self.prefill.ready)
            try:
                self._join(u)
                launched = self._launch(u) if self.ids else None
            except Exception as e:  # a forward error fails this step's rows only
                self._fail_batch(u, e)
                launched = None
            decoded = len(self.ids) if launched else 0
            prefill_tokens = (self.prefill.run(u, bool(self.ids), self._cold_launch)
                              if not steps else 0)
            self._cold_launch = False  # only this tick's launch can be a batch's first
            reads_firsts = self._inflight_firsts and self.inflight is not None
            if self.inflight is not None:
                try:
                    self._read(self.inflight, u, emitted)
                except Exception as e:
                    self._fail_batch(u, e)
                    launched = None
            self.inflight, self._inflight_firsts = launched, joining
            self.nsteps += 1
            if self.nsteps % 1024 == 0:
                mx.clear_cache()
            now = time.perf_counter()
            if decoded and not prefill_tokens:
                self.policy.observe_decode(now - t)
            kv, share, other = self._kv_report()
            steps.append(StepStat(decoded, prefill_tokens, len(emitted) - n_read, now - t,
                                  kv, self._ids_tuple, share, other))
            t = now
            if (now - t0 >= streak_s or launched is None or self.prefill.busy
                    or self.drop or reads_firsts
                    or (interrupt is not None and interrupt.is_set())
                    or any(x.finish for x in up.values())):
                break
        if self.tracer is not None:
            tr, first = self.tracer, steps[0]
            tr("n.decoded", first.decoded)
            tr("n.prefill_tokens", first.prefill_tokens)
            tr("n.emitted", len(emitted))
            tr("tick", pc() - t0)
        return TickReport(up, emitted, steps, self.busy)

    def _cancel(self, rid, u, emitted: List[tuple]):
        if not self.prefill.cancel(rid):
            r = self.rows.get(rid)
            if r is None:
                return
            if rid not in self.drop:  # a row that already ended has shown its text
                r.flush(emitted)
            self.drop.add(rid)
        u(rid).finish = "cancelled"

    def _fail_batch(self, u, e: Exception):
        msg = f"{type(e).__name__}: {e}"
        rids = list(self.ids) + list(self.inflight[0] if self.inflight else [])
        rids += [rid for g in self.prefill.ready for rid in g.row_ids()
                 if rid not in g.cancelled]
        for rid in rids:
            up = u(rid)
            if up.finish is None and rid not in self.drop:
                up.finish, up.error = "error", msg
        self.prefill.ready = []
        self._reset_batch()

    # -- batch membership --------------------------------------------------------
    @timed("filter")
    def _filter(self):
        """Drop finished/cancelled rows and rows that have launched all their tokens."""
        if not self.drop and self._headroom > 0:  # the per-step common case
            return
        keep = [i for i, rid in enumerate(self.ids)
                if rid not in self.drop
                and self.rows[rid].launched < self.rows[rid].params.max_tokens]
        if len(keep) == len(self.ids):
            return
        kept = set(keep)
        gone = [rid for i, rid in enumerate(self.ids) if i not in kept]
        if not keep:
            self.caches, self.y = None, None
        else:
            idx = mx.array(keep)
            for c in self.caches:
                c.filter(idx)
            self.y = self.y[idx]
        self.sampler.filter(keep)
        self.ids = [self.ids[i] for i in keep]
        # A row whose last tokens are still in flight keeps its host state until read.
        in_flight = set(self.inflight[0]) if self.inflight else set()
        for rid in gone:
            if rid not in in_flight or rid in self.drop:
                self.rows.pop(rid, None)
        self.drop -= set(gone)
        self._align()

    @timed("join")
    def _join(self, u):
        if not self.prefill.ready:
            return
        # Groups stay in self.prefill.ready until joined: if merging raises, tick's
        # _fail_batch must still find their rows to end them (else they sit in 'prefill').
        for cache, admits in self.prefill.joining():
            if self.caches is None:
                self.caches = cache
            else:
                for c, n in zip(self.caches, cache):
                    c.extend(n)
            last = mx.array([a.ids[-1] for a in admits])
            self.y = last if self.y is None else mx.concatenate([self.y, last])
            for a in admits:
                procs = list(a.params.logits_processors)
                if a.params.repetition_penalty is not None:
                    procs += make_logits_processors(
                        repetition_penalty=a.params.repetition_penalty)
                # every row's text is decoded here, as its tokens are read (decoding.py)
                self.rows[a.row_id] = RowDecoder(a, self.tokenizer.detokenizer, procs)
                self.masks.attach(self.rows[a.row_id])
                self.ids.append(a.row_id)
                u(a.row_id).state = "decode"
            self.sampler.extend([a.params.temperature for a in admits],
                                [a.params.filters for a in admits],
                                [a.params.seed or 0 for a in admits], [0] * len(admits))
        self.prefill.ready = []
        self._align()

    @timed("align")
    def _align(self):
        """After a membership change: what the model sees (aligned views when no row
        is padded) and the per-row facts each step needs, computed once here."""
        rows = [self.rows[rid] for rid in self.ids]
        self._batch_rows, self._ids_tuple = rows, tuple(self.ids)
        self._want_lp = [i for i, r in enumerate(rows) if r.params.logprobs]
        self._any_procs = any(r.processors for r in rows)
        self._any_constrained = any(r.matcher is not None for r in rows)
        # steps until the first row has launched all its tokens
        self._headroom = min((r.params.max_tokens - r.launched for r in rows), default=0)
        if not self.caches:
            self.views = None
            return
        aligned = not left_padded(self.caches)
        self.views = aligned_views(self.caches) if aligned else self.caches
        # the decode shape changes only here: its first step pays one-off setup
        self._cold_launch = self.shapes.first(("decode", len(rows), aligned))

    # -- compute -----------------------------------------------------------------
    @timed("launch")
    def _launch(self, u):
        rows, want, procs = self._batch_rows, self._want_lp, self._any_procs
        tr = self.tracer
        t = pc() if tr else 0.0
        logits = self.model(self.y[:, None], cache=self.views)[:, -1, :]  # [B, V]
        if want or procs or self.sampler.needs_float32:
            logits = logits.astype(mx.float32)
        if procs:
            logits = self._process(rows, logits, u)
        if self._any_constrained:  # masks.py: they fill while the forward launches
            self.masks.start(self.inflight, self.rows, rows)
            logits = self.masks.apply(logits)
        if tr:
            t = lap(tr, "launch.fwd_build", t)
        tokens = self.sampler.sample(logits)  # [B]
        if tr:
            t = lap(tr, "launch.sample", t)
        lp = None
        if want:
            k = max(rows[i].params.logprobs for i in want)
            idx = mx.array(want)
            lp = (want,) + top_logprobs(logits[idx], tokens[idx], k)
            mx.async_eval(tokens, *lp[1:])
        else:
            mx.async_eval(tokens)
        if tr:
            lap(tr, "launch.async_eval", t)
        for r in rows:
            r.launched += 1
        self._headroom -= 1
        if procs:
            for i, r in enumerate(rows):
                if r.processors:
                    r.history = mx.concatenate([r.history[-HISTORY + 1:], tokens[i:i + 1]])
        self.y = tokens
        return (list(self.ids), tokens, lp)

    def _process(self, rows, logits, u):
        """Per-row logits processors (only rows that have them pay for this)."""
        out = []
        for i, r in enumerate(rows):
            li = logits[i:i + 1]
            if r.processors and r.id not in self.drop:
                try:
                    for p in r.processors:
                        li = p(r.history, li)
                    # Only [1, vocab] logits may reach the concatenate below: anything
                    # else would fail every row in the batch, not just this one.
                    if not isinstance(li, mx.array) or li.shape != logits[i:i + 1].shape:
                        raise TypeError(f"returned {type(li).__name__} of shape "
                                        f"{getattr(li, 'shape', None)}, expected logits "
                                        f"of shape {tuple(logits[i:i + 1].shape)}")
                except Exception as e:
                    self.drop.add(r.id)
                    up = u(r.id)
                    up.finish, up.error = "error", f"logits processor failed: {type(e).__name__}: {e}"
                    li = logits[i:i + 1]
            out.append(li)
        return mx.concatenate(out, axis=0)

    # -- reading back --------------------------------------------------------------
    def _read(self, inflight, u, emitted: List[tuple]) -> None:
        ids, tokens, lp = inflight
        tr = self.tracer
        t0 = pc() if tr else 0.0
        toks = tokens.tolist()  # the one host sync per step
        if tr:
            t1 = lap(tr, "read.wait", t0)
        lps = self._read_logprobs(ids, lp) if lp is not None else None
        rows, drop = self.rows, self.drop
        for i, rid in enumerate(ids):
            r = rows.get(rid)
            if r is None or rid in drop:
                continue
            finish = r.accept(toks[i], None if lps is None else lps.get(i), emitted, self.eos)
            if r.matcher is not None:
                self.masks.advance(inflight, rows)  # once per step
                finish = self.masks.finish(
                    r, lambda t, e: r.accept(t, None, emitted, e), self.eos, finish)
            if finish is not None:
                up = u(rid)
                up.finish, up.error = finish
                if r.matcher is not None and not r.params.stop and up.finish != "error":
                    # its matcher read exactly the tokens its text decodes from
                    up.checked, up.constraint_error = True, verdict(r.params, r.matcher)
                drop.add(rid)
                if rid not in self.ids:
                    rows.pop(rid, None)
                    drop.discard(rid)
        if tr:
            lap(tr, "read.accept", t1)
            tr("read.py", pc() - t1)

    def _read_logprobs(self, ids, lp) -> dict:
        want, chosen, top_ids, top_lp = lp
        chosen = chosen.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lp = top_lp.tolist() if top_lp is not None else None
        out = {}
        for j, i in enumerate(want):
            k = self.rows[ids[i]].params.logprobs if ids[i] in self.rows else 0
            # a constrained row's disallowed tokens (-inf) are not alternatives
            out[i] = {"logprob": chosen[j],
                      "top": [(t, x) for t, x in zip(top_ids[j][:k], top_lp[j][:k])
                              if x != -math.inf] if top_ids else []}
        return out

    # -- memory ----------------------------------------------------------------------
    @timed("kv_report")
    def _kv_report(self):
        """(total bytes, bytes per batch row, {prefilling row: bytes})."""
        share, other = 0, {}
        total = 0
        if self.caches is not None and self.ids:
            batch = sum(c.nbytes for c in self.caches)
            total += batch
            share = batch // len(self.ids)
        for g in self.prefill.groups():
            b = sum(c.nbytes for c in g.cache)
            total += b
            live = [rid for rid in g.row_ids() if rid not in g.cancelled]
            for rid in live:
                other[rid] = b // max(len(live), 1)
        return total, share, other

    def close(self, clear_cache: bool = True):
        self.prefill.clear()
        self._reset_batch()
        self.masks.close()
        if self.prefix is not None:
            self.prefix.clear()
        if clear_cache:
            mx.clear_cache()
