"""Who is in the running batch, on the worker: rows leave it (`_filter`), rows whose
prefill is done join it (`_join`), and after either the per-step facts are computed
once (`_align`). `BatchExecutor` (batch.py) mixes this in; the caches, rows and
sampler are the executor's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from .._trace import timed
from ..constraint_params import kind_of
from ..messages import Updates
from ..states import RowState
from .caches import aligned_views, leaves, left_padded, sized_states
from .decoding import RowDecoder
from .windows import fit_windows
from .tokens import ids

__all__ = ["Membership"]


def _as_is(text: str) -> str:
    return text


class Membership:
    """The executor's batch membership (see batch.py `BatchExecutor`)."""

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
            idx = ids(keep)
            for c in self.caches:
                c.filter(idx)
            self.y = self.y[idx]
        self.sampler.filter(keep)
        self.ids = [self.ids[i] for i in keep]
        # A row whose last tokens are still in flight keeps its host state until read.
        in_flight = set(self.inflight.row_ids) if self.inflight else set()
        for rid in gone:
            if rid not in in_flight or rid in self.drop:
                self.rows.pop(rid, None)
        self.drop -= set(gone)
        self._align()

    @timed("join")
    def _join(self, updates: Updates):
        if not self.prefill.ready:
            return
        # Groups stay ready until all have joined: if merging raises, _fail_batch
        # must still find their rows to end them (else they sit in 'prefill').
        for piece in self.prefill.joining():
            cache, admits = piece.cache, piece.admits
            fit_windows(leaves(cache))
            if self.caches is None:
                self.caches = cache
            else:
                sized_states(self.caches, cache, self.y.shape[0], len(admits))
                for c, n in zip(self.caches, cache):
                    c.extend(n)
            last = ids([a.ids[-1] for a in admits])
            self.y = last if self.y is None else mx.concatenate([self.y, last])
            for a in admits:
                procs = list(a.params.logits_processors)
                if a.params.repetition_penalty is not None:
                    procs += make_logits_processors(
                        repetition_penalty=a.params.repetition_penalty)
                # every row's text is decoded here, as its tokens are read (decoding.py)
                detok = self.tokenizer.detokenizer
                if kind_of(a.params) is not None and hasattr(detok, "_maybe_trim_space"):
                    # a constrained row's text is what its matcher accepted, a leading
                    # space included (mlx-lm's BPE detokenizer drops one: " no" -> "no")
                    detok._maybe_trim_space = _as_is
                self.rows[a.row_id] = RowDecoder(a, detok, procs)
                self.masks.attach(self.rows[a.row_id])
                self.spec.attach(self.rows[a.row_id], a.ids)
                self.ids.append(a.row_id)
                updates.of(a.row_id).state = RowState.DECODE
            self.sampler.extend([a.params.temperature for a in admits],
                                [a.params.filters for a in admits],
                                [a.params.seed or 0 for a in admits], [0] * len(admits))
        self.prefill.take_ready()
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
        self._any_spec = any(r.spec is not None for r in rows)
        self._any_fixed_draft = any(r.spec is not None and r.spec.fixed for r in rows)
        self._row_adapters = tuple(r.params.adapter for r in rows)
        # steps until the first row has launched all its tokens
        self._headroom = min((r.params.max_tokens - r.launched for r in rows), default=0)
        if not self.caches:
            self.views = None
            return
        aligned = not left_padded(self.caches)
        self.views = (aligned_views(self.caches, windows=self.setup.lean_windows)
                      if aligned else self.caches)
        # the decode shape changes only here: its first step pays one-off setup
        self._cold_launch = self.shapes.first(("decode", len(rows), aligned))
