"""MLX batch execution: everything here runs on the engine's one worker thread.

One step = drop finished rows from the batch, join rows whose prefill is complete,
launch decode step N+1, prefill up to one chunk, then read step N's tokens (so the
device computes N+1 while the host reads N), detokenize and check stops
(readback.py). A `tick` takes one step, and then more while nothing needs the loop
(`_streak_goes_on`): each return trip through the event loop costs host time the
device waits for. The loop gets back plain Python values (messages.py: `TickReport`).

Admitted rows prefill in groups (prefill.py: a `Prefill` the executor owns);
a done group's cache joins the running left-padded batch cache (caches.py: every
cache kind mlx-lm's models make, in any per-layer mix) and each row's last prompt
token is its first decode input. When no row is padded the model sees plain-KVCache
views of its KV layers: no mask array, scalar RoPE offsets.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

import mlx.core as mx

from ..._log import Laps
from .._trace import lap, pc, timed
from ..constrain import Constraints
from ..messages import (Admit, Emitted, LoadFacts, StepStat, TickReport, Updates,
                        WorkerState)
from ..states import Finish
from .adapters import AdapterSet
from .decoding import HISTORY, RowDecoder
from .inflight import InFlight, LogprobArrays
from .masks import MaskFiller
from .membership import Membership
from .prefill import Prefill
from .prefill_policy import PrefillPolicy, ShapeMemory
from .prefix import PrefixStore
from .readback import ReadBack
from .kernels_ahead import ModelKernels
from . import gated_delta_prefill, own_kernels, precompile
from .sampling import BatchSampler
from .setup import BatchModel
from .draft import DraftSource
from .speculate import Speculation
from .stepsplit import StepSplit
from .tokens import ids


class BatchExecutor(ReadBack, Membership):
    def __init__(self, model, tokenizer, prefill_chunk: Optional[int] = None,
                 prefix_bytes: int = 0, fuse: bool = False,
                 kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 fill_threads: Optional[int] = None,
                 constraints: Optional[Constraints] = None, draft=None,
                 speculates: bool = False):
        self.prefix_bytes = prefix_bytes
        # CUDA: kernels compile in helper processes, all at once (a fresh machine
        # compiles them once): the sampler's in the background, the model's first
        # ones before the load probes below need them (kernels_ahead.py)
        laps = Laps("load")
        self.precompiler = precompile.for_vocab(precompile.logit_width(model))
        self.precompiler.start()  # (or goes on with the compile another engine began)
        # a delta-net's recurrence over a chunk as one kernel, this thread's forwards
        # (checked in BatchModel; offered first, so the survey sees what loads run)
        gated_delta_prefill.offer(model)
        ahead = ModelKernels.for_model(model, tokenizer)
        if ahead.start():
            own_kernels.warm(model, kv_bits)  # meanwhile, this package's (own_kernels.py)
            ahead.wait()
        laps("kernels compiled ahead")
        self.setup = BatchModel(model, tokenizer, fuse=fuse, kv_bits=kv_bits,
                                kv_group_size=kv_group_size, prefill_chunk=prefill_chunk,
                                verify_kernel=speculates)
        laps("model checks")
        self.model, self.tokenizer = model, tokenizer
        self.make_cache = self.setup.make_cache
        self.tracer = None  # see trace()
        self.eos = set(tokenizer.eos_token_ids or ())
        self.prefix = PrefixStore(prefix_bytes, self.make_cache) if (
            prefix_bytes and self.setup.prefix_reusable) else None
        self.shapes = ShapeMemory()
        self.adapters = AdapterSet(model, owner=self)  # LoRA/DoRA rows (adapters.py)
        # compiled recurrent decode steps hold base weights (recurrent.py)
        self.setup.decode_gate = lambda: self.adapters.sel is None
        self.policy = PrefillPolicy(prefill_chunk)
        self.prefill = Prefill(model, self.make_cache, self.policy, self.shapes,
                               self.prefix, pad_safe=self.setup.pad_safe,
                               adapters=self.adapters)
        self._cold_launch = False  # a new decode batch shape (set by _align), this tick
        # constrain.py: per-row grammars; masks.py: their masks each step
        self.constraints = constraints or Constraints(tokenizer)
        self.masks = MaskFiller(self.constraints, fill_threads)
        self.spec = Speculation(self.make_cache())  # speculate.py: drafts and their checks
        draft = DraftSource.build(draft, model, tokenizer, self)  # draft.py: a draft model
        if draft is not None:
            self.spec.add_draft(draft)
        self._reset_batch()
        self.nsteps = 0
        self._wide_read = (0, 0)  # the last pipelined verification read: (drafts, accepted)
        self.taken = 0  # tokens rows have taken (the speculation guard's count)
        self._wide_taken = None  # and its (width, tokens taken), for the policy
        # every step's time split (stepsplit.py); a profiler's tracer rides on it
        self.split = self.tracer = self.prefill.tracer = StepSplit()
        laps("batch state")

    def trace(self, tracer) -> None:
        """Report each tick's parts to `tracer(name, seconds)` (_trace.py); None: off."""
        self.split.user = self.masks.tracer = tracer

    def _reset_batch(self):
        self.ids: List[int] = []  # row ids in batch order
        self.rows: Dict[int, RowDecoder] = {}
        self.caches: Optional[list] = None
        self.views: Optional[list] = None  # what the model sees: caches or aligned views
        self.y: Optional[mx.array] = None  # [B] next input tokens
        self.sampler = BatchSampler()
        self.inflight: Optional[InFlight] = None  # the last launch, read next step
        self.drop: set = set()
        self._batch_rows, self._want_lp, self._any_procs, self._headroom = [], [], False, 0
        self._ids_tuple: tuple = ()  # self.ids, shared by step records until it changes
        self._row_adapters: tuple = ()  # each batch row's adapter name (None: base)
        self._any_constrained = self._any_spec = self._any_fixed_draft = False
        self.masks.reset()

    @property
    def busy(self) -> bool:
        return bool(self.prefill.busy or self.ids or self.inflight)

    def facts(self) -> LoadFacts:
        s = self.setup
        prefix = "on" if self.prefix is not None else (
            "off for these cache kinds" if self.prefix_bytes else "off")
        draft = self.spec.draft  # a draft model's KV rides with each row (draft.py)
        costs = list(s.layer_costs) + (list(draft.kv_costs) if draft is not None else [])
        return LoadFacts(s.cache_kinds, costs, s.quantized_attention, prefix,
                         self.spec.facts, s.paths)

    def report(self) -> TickReport:
        """What a tick would report, without taking a step."""
        return TickReport({}, [], [], self.busy, self.policy.current)

    def state(self) -> WorkerState:
        return WorkerState(self.busy, list(self.ids), list(self.rows),
                           self.prefill.prefilling, len(self.prefill.ready),
                           self.inflight is not None, len(self.drop),
                           self.caches is not None,
                           self.prefix.nbytes if self.prefix is not None else 0,
                           self.policy.current)

    # -- the tick ----------------------------------------------------------------
    def tick(self, admits: List[Admit], cancels: List[int], streak_s: float = 0.0,
             interrupt: Optional[threading.Event] = None) -> TickReport:
        """One scheduler iteration: one step, and with `streak_s` > 0 more steps for
        up to that long while nothing needs the loop (`_streak_goes_on`)."""
        updates, emitted = Updates(), []
        if self.precompiler.pending:
            self.precompiler.poll()
        for rid in cancels:
            self._cancel(rid, updates, emitted)
        self.prefill.admit(admits)
        steps: List[StepStat] = []
        t0 = time.perf_counter()
        while True:
            st, launched, read_firsts = self._step(updates, emitted)
            steps.append(st)
            if not self._streak_goes_on(launched, read_firsts, updates,
                                        time.perf_counter() - t0 < streak_s, interrupt):
                break
        if self.tracer is not None:
            tr, first = self.tracer, steps[0]
            tr("n.decoded", first.decoded)
            tr("n.prefill_tokens", first.prefill_tokens)
            tr("n.emitted", len(emitted))
            tr("tick", pc() - t0)
        return TickReport(updates.by_row, emitted, steps, self.busy, self.policy.current,
                          self.prefix.nbytes if self.prefix is not None else 0)

    def _step(self, updates: Updates, emitted: List[Emitted]):
        """One decode step with what rides along: (its StepStat, whether a decode was
        launched, whether a joined row's first token was read)."""
        t = time.perf_counter()
        self._filter()
        n_read = len(emitted)
        joining = bool(self.prefill.ready)
        verified = None  # a verify step's (proposed, accepted, taken, width)
        taken0 = self.taken
        drained = False  # the step in flight was read before this step's launch
        try:
            self._join(updates)
            launched = None
            if self.ids:
                if self.spec.wanted(self):
                    if self.spec.pipelined(self):  # read back a step later (wide.py)
                        launched = self.spec.launch(self)
                    else:
                        verified = self.spec.step(self, updates, emitted)
                        drained = self.spec.drained
                if verified is None and launched is None:
                    self.spec.settle(self)
                    launched = self._launch(updates)
        except Exception as e:  # a forward error fails this step's rows only
            self._fail_batch(updates, e)
            launched = verified = None
        if launched is not None:
            launched.firsts = joining
        decoded = len(self.ids) if launched or verified else 0
        prefill_tokens = (self.prefill.run(updates, bool(self.ids), self._cold_launch)
                          if self.prefill.busy else 0)
        self._cold_launch = False  # only a batch's first launch is cold
        done = self.inflight  # launched a step ago: computed by now
        read_firsts = done is not None and done.firsts
        if done is not None:
            try:
                self._read(done, updates, emitted)
            except Exception as e:
                self._fail_batch(updates, e)
                launched = None
        self.inflight = launched
        self.nsteps += 1
        if self.nsteps % 1024 == 0:
            mx.clear_cache()
        now = time.perf_counter()
        if decoded and not prefill_tokens:
            self.policy.observe_decode(now - t)
            self.spec.observe(decoded, now - t, verified, drained, done is not None,
                              launched is not None and launched.accepted is not None,
                              self._wide_taken, self.taken - taken0)
        self._wide_taken = None
        kv, share, other = self._kv_report()
        st = StepStat(decoded, prefill_tokens, len(emitted) - n_read, now - t, kv,
                      self._ids_tuple, share, other, self.split.take(now - t))
        wd, wa = self._wide_read  # pipelined verifications read this step
        self._wide_read = (0, 0)
        if verified is not None:
            wd, wa = wd + verified[0], wa + verified[1]
        st.drafted, st.accepted = wd, wa
        return st, launched is not None or verified is not None, read_firsts

    def _streak_goes_on(self, launched: bool, read_firsts: bool, updates: Updates,
                        in_time: bool, interrupt: Optional[threading.Event]) -> bool:
        """Another step before returning to the loop? Only a plain decode step with
        nothing for the loop to act on: no prefill work, no row ending or leaving, no
        first token to show (its TTFT), no new rows or cancels waiting there."""
        return (in_time and launched and not self.prefill.busy and not self.drop
                and not read_firsts and not updates.endings
                and not (interrupt is not None and interrupt.is_set()))

    def _cancel(self, rid, updates: Updates, emitted: List[Emitted]):
        if not self.prefill.cancel(rid):
            r = self.rows.get(rid)
            if r is None:
                return
            if rid not in self.drop:  # a row that already ended has shown its text
                r.flush(emitted)
            self.drop.add(rid)
        updates.end(rid, Finish.CANCELLED)

    def _fail_batch(self, updates: Updates, e: Exception):
        msg = f"{type(e).__name__}: {e}"
        rids = list(self.ids) + list(self.inflight.row_ids if self.inflight else [])
        rids += self.prefill.fail()
        for rid in rids:
            if not updates.ended(rid) and rid not in self.drop:
                updates.end(rid, Finish.ERROR, msg)
        self._reset_batch()

    # -- compute -----------------------------------------------------------------
    @timed("launch")
    def _launch(self, updates: Updates) -> InFlight:
        rows, want, procs = self._batch_rows, self._want_lp, self._any_procs
        tr = self.tracer
        t = pc() if tr else 0.0
        with self.adapters.using(self.adapters.select(self._row_adapters)):
            logits = self.model(self.y[:, None], cache=self.views)[:, -1, :]  # [B, V]
        if want or procs or self.sampler.needs_float32:
            logits = logits.astype(mx.float32)
        if procs:
            logits = self._process(rows, logits, updates)
        if self._any_constrained:  # masks.py: they fill while the forward launches
            self.masks.start(self.inflight, self.rows, rows)
            logits = self.masks.apply(logits)
        if tr:
            t = lap(tr, "launch.fwd_build", t)
        tokens = self.sampler.sample(logits, keep=bool(want))  # [B]
        if tr:
            t = lap(tr, "launch.sample", t)
        lp = None
        if want:
            k = max(rows[i].params.logprobs for i in want)
            idx = ids(want)
            # the distribution each row was drawn from (sampling.py)
            top = self.sampler.logprobs(idx, tokens[idx], k)
            lp = LogprobArrays(want, top.chosen, top.top_ids, top.top_logprobs,
                               self.masks.allowed if self._any_constrained else None)
            mx.async_eval(tokens, *[a for a in (lp.chosen, lp.top_ids, lp.top_logprobs)
                                    if a is not None])
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
        return InFlight(list(self.ids), tokens, lp)

    def _process(self, rows, logits, updates: Updates):
        """Per-row logits processors (only rows that have them pay for this)."""
        out = []
        for i, r in enumerate(rows):
            li = logits[i:i + 1]
            if r.processors and r.id not in self.drop:
                try:
                    for p in r.processors:
                        li = p(r.history, li)
                        # Only [1, vocab] logits may reach the next processor (mlx-lm's
                        # own would fail inside) and the concatenate below, which
                        # would fail every row in the batch, not just this one.
                        if not isinstance(li, mx.array) or li.shape != logits[i:i + 1].shape:
                            raise TypeError(
                                f"{getattr(p, '__qualname__', type(p).__name__)} returned "
                                f"{type(li).__name__} of shape {getattr(li, 'shape', None)}, "
                                f"expected logits of shape {tuple(logits[i:i + 1].shape)}")
                except BaseException as e:  # (sys.exit(), a CancelledError too; and a
                    # KeyboardInterrupt: signals reach the main thread only, so on the
                    # worker it is the callback's own raise)
                    self.drop.add(r.id)
                    updates.end(r.id, Finish.ERROR,
                                f"logits processor failed: {type(e).__name__}: {e}")
                    li = logits[i:i + 1]
            out.append(li)
        return mx.concatenate(out, axis=0)

    # -- memory ----------------------------------------------------------------------
    @timed("kv_report")
    def _kv_report(self):
        """(total bytes, bytes per batch row, {prefilling row: bytes})."""
        share, other = 0, {}
        total = 0
        if self.caches is not None and self.ids:
            batch = sum(c.nbytes for c in self.caches)
            draft = self.spec.draft  # its KV is held for rows of the decode batch
            if draft is not None and draft.caches is not None:
                batch += sum(c.nbytes for c in draft.caches)
            total += batch
            share = batch // len(self.ids)
        for g in self.prefill.groups():
            b = sum(c.nbytes for c in g.cache)
            total += b
            live = [rid for rid in g.row_ids() if rid not in g.cancelled]
            for rid in live:
                other[rid] = b // max(len(live), 1)
        return total, share, other

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name`, and forget the prompt KV computed under it."""
        self.adapters.remove(name)
        if self.prefix is not None:
            self.prefix.forget(name)

    def close(self, clear_cache: bool = True):
        """Forget every row; `clear_cache` (a final close, unlike warm-up's reset)
        also frees MLX's buffer cache. A background compile of the sampling kernels
        goes on for the process's next engine (precompile.for_vocab)."""
        self.prefill.clear()
        self._reset_batch()
        self.masks.close()
        if self.prefix is not None:
            self.prefix.clear()
        if clear_cache:
            mx.clear_cache()

    def shut(self):
        """The engine's last close: also take its adapters' hooks off the model (which
        may serve another engine's adapters next)."""
        self.close()
        self.adapters.close()
