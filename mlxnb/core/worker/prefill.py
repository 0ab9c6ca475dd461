"""Prompt prefill, the half of batch execution before rows decode.

Admitted rows (`waiting`) prefill in groups (`current`): all prompt tokens but the
last, as one right-padded batch, or alone, continuing from a reused prefix. A done
group waits in `ready` until the executor's next tick joins it to the decode batch.
How much to prefill per tick is `PrefillPolicy`'s call: beside running rows a step
budget (`prefill_chunk`, or about STALL_S of prefill at the measured rate); with
nothing decoding, bigger ticks that still let cancels land. Shapes repeat from run
to run (widths in multiples of PREFILL_BUCKET, power-of-two chunks, groups formed
from what waits), because MLX's CUDA backend sets up kernels per new shape.

The executor (batch.py) owns a `Prefill`: it hands over admitted rows (`admit`),
says each step whether rows are decoding and whether this step's decode launch was
a new shape (`run`, which returns the tokens prefilled), joins the ready groups
(`joining`, then `take_ready`) and, if the batch fails, takes the rows it held
(`fail`). Only `Prefill`'s own methods change its containers.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Iterable, Iterator, List, NamedTuple, Optional

import mlx.core as mx

from .._trace import lap, pc, timed
from ..messages import Updates
from ..states import Finish
from .caches import aligned_views, chunk_lengths, empty_batch, merge_lean, round_up
from .prefill_policy import PREFILL_BUCKET, PrefillPolicy, ShapeMemory, pow2_floor
from .tokens import ids

class PrefillGroup:
    """Rows prefilling together on one cache: a fresh batch (prompts right-padded,
    the caches' prepare/finalize turn that into left padding, and recurrent states
    mask the padded steps out), or one row continuing from a reused prefix on its
    own single-row cache."""

    def __init__(self, admits: list, cache: list, start: int, batched: bool,
                 width: Optional[int] = None):
        self.admits, self.cache, self.pos, self.batched = admits, cache, start, batched
        self.lengths = [len(a.ids) - 1 for a in admits]  # all but the last token
        self.width = width or max(self.lengths)
        self.step = 1  # chunk widths are multiples of this
        self.cancelled: set = set()
        self.views = cache
        self.padded = False
        if batched:
            pad = [self.width - n for n in self.lengths]
            self.tokens = ids([a.ids[:-1] + [0] * p for a, p in zip(admits, pad)]
                                   if self.width else [[0]] * len(admits))
            self.padded = max(pad) > 0
            if self.padded:
                for c in cache:
                    c.prepare(lengths=self.lengths, right_padding=pad)
            # Right padding sits after every real token, so causal masking alone
            # keeps real tokens of KV layers from seeing it.
            self.views = aligned_views(cache)
        else:
            self.tokens = ids([admits[0].ids[:-1]])

    def row_ids(self):
        return [a.row_id for a in self.admits]


class Joining(NamedTuple):
    cache: list  # a batch cache, one row per admit
    admits: list  # the rows it holds, in batch order


class Prefill:
    """Admitted rows from `waiting` through prefill groups to `ready`. With
    `pad_safe` False (the model lets padding into its state: padding_stays_out),
    groups hold prompts of one length only, unbucketed, so none is padded."""

    def __init__(self, model, make_cache: Callable[[], list], policy: PrefillPolicy,
                 shapes: ShapeMemory, prefix=None, pad_safe: bool = True,
                 adapters=None):
        self.model, self.make_cache, self.policy = model, make_cache, policy
        self.adapters = adapters  # adapters.AdapterSet: each row's LoRA/DoRA
        self.shapes, self.prefix = shapes, prefix
        self.pad_safe = pad_safe
        self.tracer = None  # BatchExecutor.trace
        self.waiting: Deque = deque()  # Admits, prefill not started
        self.current: Optional[PrefillGroup] = None  # the group being prefilled
        self.ready: List[PrefillGroup] = []  # prefilled, joining at the next tick
        self.cold_chunk = False  # this tick ran a chunk shape for the first time

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.current or self.ready)

    @property
    def prefilling(self) -> List[int]:
        """Rows admitted whose prefill has not finished."""
        return [a.row_id for a in self.waiting] + (
            [r for r in self.current.row_ids() if r not in self.current.cancelled]
            if self.current else [])

    def groups(self) -> List[PrefillGroup]:
        """Groups holding caches: the one prefilling, then the ready ones."""
        return ([self.current] if self.current else []) + self.ready

    def cancel(self, rid: int) -> bool:
        """Drop a row that has not joined the decode batch; False if it is not here."""
        for a in self.waiting:
            if a.row_id == rid:
                self.waiting.remove(a)
                return True
        hit = False
        for g in self.groups():
            if rid in g.row_ids():
                g.cancelled.add(rid)
                hit = True
        return hit

    def admit(self, admits: Iterable) -> None:
        """Rows the scheduler admitted, in order: they prefill from the next `run`."""
        self.waiting.extend(admits)

    def take_ready(self) -> None:
        """The ready groups have joined the decode batch (after `joining`)."""
        self.ready = []

    def fail(self) -> List[int]:
        """The batch failed: forget the ready groups; returns their live rows."""
        rids = [rid for g in self.ready for rid in g.row_ids() if rid not in g.cancelled]
        self.ready = []
        return rids

    def clear(self):
        self.waiting.clear()
        self.current = None
        self.ready = []

    @timed("prefill")
    def run(self, updates: Updates, decoding: bool, cold_launch: bool) -> int:
        """Prefill up to one step budget of tokens beside a running batch (its stall is
        bounded by that). With nothing decoding, group everything admitted (up to
        IDLE_PREFILL tokens) so the rows start decoding together, unpadded, but still
        compute only about IDLE_TICK_S of it per tick, so cancels land promptly.
        Returns the prompt tokens prefilled."""
        budget, group_budget = self.policy.plan(decoding)
        done = 0
        self.cold_chunk = False
        t0 = time.perf_counter()
        while done < budget:
            if self.current is None:
                self.current = self.next_group(group_budget or budget - done, budget,
                                               decoding)
                if self.current is None:
                    break
            g = self.current
            if len(g.cancelled) == len(g.admits):  # every row cancelled: drop it
                self.current = None
                continue
            if done and g.pos == 0 and len(g.admits) * g.width > budget - done:
                break
            try:
                done += self.chunk(g, budget - done, updates)
            except Exception as e:
                for rid in g.row_ids():
                    if rid not in g.cancelled:
                        updates.end(rid, Finish.ERROR,
                                    f"prefill failed: {type(e).__name__}: {e}")
                self.current = None
            if self.current is g:  # one chunk per group per tick (a power of two of
                break  # the budget, not a string of ever smaller shapes)
        if done:
            self.policy.observe_prefill(done, time.perf_counter() - t0, decoding,
                                        self.cold_chunk or (decoding and cold_launch))
        return done

    def joining(self) -> Iterator["Joining"]:
        """A batch cache and its admits for each piece of `ready` to join, in order, cancelled
        rows left out. Rows that prefilled alone (prefix hits) merge into one batch
        first: each extend copies the whole running batch, so 32 hits joined one by one
        cost 285 ms on 2 CPU cores, one merge and one extend 47 ms."""
        alone: list = []

        def merged():
            layers = range(len(alone[0].cache))
            cache = merge_lean([[g.cache[i] for g in alone] for i in layers])
            out = Joining(cache, [g.admits[0] for g in alone])
            alone.clear()
            return out

        for g in self.ready:
            if not g.batched:
                if g.admits[0].row_id not in g.cancelled:
                    alone.append(g)
                continue
            if alone:
                yield merged()
            keep = [i for i, a in enumerate(g.admits) if a.row_id not in g.cancelled]
            if not keep:
                continue
            if len(keep) < len(g.admits):
                for c in g.cache:
                    c.filter(ids(keep))
            yield Joining(g.cache, [g.admits[i] for i in keep])
        if alone:
            yield merged()

    def next_group(self, budget: int, step_budget: int,
                   decoding: bool) -> Optional[PrefillGroup]:
        t = pc() if self.tracer else 0.0
        g = self._next_group(budget, step_budget, decoding)
        if self.tracer:
            lap(self.tracer, "prefill.group", t)
            if g is not None:
                self.tracer("n.groups", 1)
                self.tracer("n.group_rows", len(g.admits))
        return g

    def _next_group(self, budget: int, step_budget: int,
                    decoding: bool) -> Optional[PrefillGroup]:
        """The next group: rows from the head of `waiting` whose padded widths fit
        `budget` tokens; beside a running batch also at most one bucket per row
        within `step_budget` (a chunk is at least one bucket wide per row)."""
        if not self.waiting:
            return None
        head = self.waiting.popleft()
        if self.prefix is not None:
            hit = self.prefix.lookup(head.ids, head.params.adapter)
            if hit.tokens:
                g = PrefillGroup([head], hit.cache, hit.tokens, batched=False)
                g.cached = hit.tokens
                return g
        # Joiners of a running batch get padded to it anyway: round their widths up
        # so prefill shapes repeat (backends that prepare kernels per shape, e.g.
        # cuDNN attention on CUDA, then reuse them).
        step = min(PREFILL_BUCKET, step_budget) if decoding and self.pad_safe else 1
        most = max(1, step_budget // step) if decoding else len(self.waiting) + 1
        group = [head]
        width = round_up(len(head.ids) - 1, step)
        while self.waiting and len(group) < most:
            a = self.waiting[0]
            if not self.pad_safe and len(a.ids) != len(head.ids):
                break
            w = max(width, round_up(len(a.ids) - 1, step))
            if (len(group) + 1) * w > max(budget, width):
                break
            if self.prefix is not None and self.prefix.lookup(
                    a.ids, a.params.adapter).tokens:
                break  # it prefills faster on its own, from the reused prefix
            group.append(self.waiting.popleft())
            width = w
        cache = empty_batch(self.make_cache(), len(group))
        g = PrefillGroup(group, cache, 0, batched=True, width=width)
        g.cached, g.step = 0, step
        return g

    def chunk(self, g: PrefillGroup, budget: int, updates: Updates) -> int:
        k = len(g.admits)
        # Powers of two (multiples of the group's step): chunk shapes repeat from run
        # to run, and cache growth stays within kv_bytes_for's slack.
        n = min(g.width - g.pos, max(g.step, pow2_floor(budget // k)))
        if n > 0:
            if self.shapes.first(("prefill", k, g.pos, n, g.batched)):
                self.cold_chunk = True
            cols = g.tokens[:, g.pos:g.pos + n]
            if g.padded:
                chunk_lengths(g.cache, [min(max(m - g.pos, 0), n) for m in g.lengths])
            tr = self.tracer
            t = pc() if tr else 0.0
            if self.adapters is not None:
                # a cancelled row's adapter may be unloaded by now: it runs as base
                with self.adapters.using(self.adapters.select(tuple(
                        None if a.row_id in g.cancelled else a.params.adapter
                        for a in g.admits))):
                    self.model(cols, cache=g.views)
            else:
                self.model(cols, cache=g.views)
            if tr:
                t = lap(tr, "prefill.fwd_build", t)
            mx.eval([c.state for c in g.cache])
            if tr:
                lap(tr, "prefill.eval", t)
            g.pos += n
        if g.pos >= g.width:
            if g.batched and g.padded:
                for c in g.cache:
                    c.finalize()
                mx.eval([c.state for c in g.cache])
            self.remember(g)
            self.current = None
            self.ready.append(g)
        for a, length in zip(g.admits, g.lengths):
            if a.row_id not in g.cancelled:
                upd = updates.of(a.row_id)
                upd.prefill_done = len(a.ids) if g.pos >= g.width else min(g.pos, length)
                if g.cached:
                    upd.cached_tokens = g.cached
        return max(n, 0) * k

    def remember(self, g: PrefillGroup):
        if self.prefix is None or not g.width:
            return
        layers = [(c.keys, c.values) for c in g.cache]
        for i, (a, length) in enumerate(zip(g.admits, g.lengths)):
            if length and a.row_id not in g.cancelled:  # (a cancelled row ran as base)
                self.prefix.add(a.ids[:length], layers, i, g.width - length if g.batched else 0,
                                a.params.adapter)
