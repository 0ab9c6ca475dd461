"""MLX batch execution: everything here runs on the engine's one worker thread.

One `tick` = apply cancellations, admit rows, drop finished rows from the batch, join
rows whose prefill is complete, launch decode step N+1, run one prefill chunk, then
read step N's tokens (so the device computes N+1 while the host reads N), detokenize
and check stops. The loop thread gets back plain Python values (`TickReport`).

Rows prefill alone, on their own cache, `prefill_chunk` tokens per tick, all but their
last prompt token; then their cache is merged into the running left-padded batch
cache (mlx-lm's `BatchKVCache` / `BatchRotatingKVCache`) and the last prompt token is
their first decode input.
"""

from __future__ import annotations

import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from .prefix import PrefixStore
from .rows import SamplingParams
from .sampling import BatchSampler, top_logprobs

SUPPORTED_CACHES = (KVCache, RotatingKVCache)
_HISTORY = 256  # tokens of context kept for logits processors (repetition penalty)


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
    tokens: List[int] = field(default_factory=list)
    text: str = ""  # newly visible text
    logprobs: Optional[List[dict]] = None
    finish: Optional[str] = None
    error: Optional[str] = None


@dataclass
class TickReport:
    updates: Dict[int, RowUpdate]
    decoded: int  # rows in the decode step launched this tick
    prefill_tokens: int
    emitted: int  # tokens read back this tick
    kv_bytes: int
    row_kv_bytes: Dict[int, int]
    busy: bool  # more work pending inside the executor


class _Prefill:
    def __init__(self, a: Admit, cache: list):
        self.admit, self.cache, self.pos, self.looked_up = a, cache, 0, False


class _Decode:
    """Host-side state of one decoding row."""

    def __init__(self, a: Admit, detok, processors):
        self.id = a.row_id
        self.params = a.params
        self.detok = detok
        self.processors = processors
        self.history = mx.array(a.ids[-_HISTORY:]) if processors else None
        self.launched = 0  # decode steps launched for this row
        self.ntok = 0
        self.text = ""  # full detokenized text
        self.shown = 0  # chars of text already reported
        self.hold = max((len(s) for s in a.params.stop if isinstance(s, str)), default=0)


class BatchExecutor:
    def __init__(self, model, tokenizer, prefill_chunk: int = 512, prefix_bytes: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.prefill_chunk = prefill_chunk
        self.eos = set(tokenizer.eos_token_ids or ())
        probe = make_prompt_cache(model)
        bad = {type(c).__name__ for c in probe if type(c) not in SUPPORTED_CACHES}
        if bad:
            raise ValueError(
                f"mlxnb batches models whose caches are KVCache or RotatingKVCache; this "
                f"model uses {', '.join(sorted(bad))}. Use mlx_lm.generate for it.")
        self.layer_shapes = self._probe_kv(probe)
        self.prefix = PrefixStore(prefix_bytes) if PrefixStore.supports(probe) else None
        self.prefilling: "OrderedDict[int, _Prefill]" = OrderedDict()
        self.ready: List[_Prefill] = []
        self._reset_batch()
        self.nsteps = 0

    def _probe_kv(self, cache) -> List[tuple]:
        """[(bytes per token, window or None)] per layer, read off a real 1-token forward."""
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        out = []
        for c in cache:
            per_tok = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            out.append((per_tok, c.max_size if isinstance(c, RotatingKVCache) else None))
        return out

    def kv_bytes_for(self, length: int) -> int:
        """Real bytes a cache holding `length` tokens allocates (256-token steps)."""
        alloc = -(-max(length, 1) // 256) * 256
        return sum(b * (min(alloc, w) if w else alloc) for b, w in self.layer_shapes)

    def _reset_batch(self):
        self.ids: List[int] = []  # row ids in batch order
        self.rows: Dict[int, _Decode] = {}
        self.caches: Optional[list] = None
        self.y: Optional[mx.array] = None  # [B] next input tokens
        self.sampler = BatchSampler()
        self.inflight = None  # (row ids, tokens [B], logprob arrays) of the last launch
        self.drop: set = set()

    @property
    def busy(self) -> bool:
        return bool(self.prefilling or self.ready or self.ids or self.inflight)

    # -- the tick ----------------------------------------------------------------
    def tick(self, admits: List[Admit], cancels: List[int]) -> TickReport:
        up: Dict[int, RowUpdate] = {}

        def u(rid) -> RowUpdate:
            return up.setdefault(rid, RowUpdate(rid))

        for rid in cancels:
            if self.prefilling.pop(rid, None) is not None or any(
                    j.admit.row_id == rid for j in self.ready):
                self.ready = [j for j in self.ready if j.admit.row_id != rid]
                u(rid).finish = "cancelled"
            elif rid in self.rows:
                self.drop.add(rid)
                u(rid).finish = "cancelled"
        for a in admits:
            self.prefilling[a.row_id] = _Prefill(a, make_prompt_cache(self.model))
            u(a.row_id).state = "prefill"

        self._filter()
        decoded = 0
        try:
            self._join(u)
            if self.ids:
                launched = self._launch(u)
                decoded = len(self.ids)
            else:
                launched = None
        except Exception as e:  # a forward error fails this step's rows, not the engine
            self._fail_batch(u, e)
            launched = None
        prefill_tokens = self._prefill_chunk(u)
        emitted = 0
        if self.inflight is not None:
            try:
                emitted = self._read(self.inflight, u)
            except Exception as e:
                self._fail_batch(u, e)
                launched = None
        self.inflight = launched
        self.nsteps += 1
        if self.nsteps % 256 == 0:
            mx.clear_cache()
        kv, per_row = self._kv_report()
        return TickReport(up, decoded, prefill_tokens, emitted, kv, per_row, self.busy)

    def _fail_batch(self, u, e: Exception):
        msg = f"{type(e).__name__}: {e}"
        for rid in list(self.ids) + list(self.inflight[0] if self.inflight else []):
            if rid not in self.drop:
                up = u(rid)
                if up.finish is None:
                    up.finish, up.error = "error", msg
        for j in self.ready:
            up = u(j.admit.row_id)
            up.finish, up.error = "error", msg
        self.ready = []
        self._reset_batch()

    # -- batch membership --------------------------------------------------------
    def _filter(self):
        """Drop finished/cancelled rows and rows that have launched all their tokens."""
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

    def _join(self, u):
        if not self.ready:
            return
        jobs, self.ready = self.ready, []
        new = [type(layer).merge([j.cache[i] for j in jobs]) for i, layer in
               enumerate(jobs[0].cache)]
        if self.caches is None:
            self.caches = new
        else:
            for c, n in zip(self.caches, new):
                c.extend(n)
        last = mx.array([j.admit.ids[-1] for j in jobs])
        self.y = last if self.y is None else mx.concatenate([self.y, last])
        for j in jobs:
            a = j.admit
            procs = list(a.params.logits_processors)
            if a.params.repetition_penalty is not None:
                procs += make_logits_processors(repetition_penalty=a.params.repetition_penalty)
            self.rows[a.row_id] = _Decode(a, self.tokenizer.detokenizer, procs)
            self.ids.append(a.row_id)
            u(a.row_id).state = "decode"
        self.sampler.extend([j.admit.params.temperature for j in jobs],
                            [j.admit.params.filters for j in jobs],
                            [j.admit.params.seed or 0 for j in jobs],
                            [0] * len(jobs))

    # -- compute -----------------------------------------------------------------
    def _launch(self, u):
        rows = [self.rows[rid] for rid in self.ids]
        logits = self.model(self.y[:, None], cache=self.caches)[:, -1, :]  # [B, V]
        logits = logits.astype(mx.float32)
        if any(r.processors for r in rows):
            logits = self._process(rows, logits, u)
        tokens = self.sampler.sample(logits)  # [B]
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        lp = None
        if want:
            k = max(rows[i].params.logprobs for i in want)
            idx = mx.array(want)
            lp = (want,) + top_logprobs(logits[idx], tokens[idx], k)
            mx.async_eval(tokens, *lp[1:])
        else:
            mx.async_eval(tokens)
        for i, r in enumerate(rows):
            r.launched += 1
            if r.processors:
                r.history = mx.concatenate([r.history[-_HISTORY + 1:], tokens[i:i + 1]])
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
                except Exception as e:
                    self.drop.add(r.id)
                    up = u(r.id)
                    up.finish, up.error = "error", f"logits processor failed: {type(e).__name__}: {e}"
                    li = logits[i:i + 1]
            out.append(li)
        return mx.concatenate(out, axis=0)

    def _prefill_chunk(self, u) -> int:
        if not self.prefilling:
            return 0
        rid, job = next(iter(self.prefilling.items()))
        ids = job.admit.ids
        if not job.looked_up:
            job.looked_up = True
            if self.prefix is not None:
                n, cache = self.prefix.lookup(ids)
                if n:
                    job.cache, job.pos = cache, n
                    u(rid).cached_tokens = n
        n = min(self.prefill_chunk, len(ids) - 1 - job.pos)
        try:
            if n > 0:
                self.model(mx.array(ids[job.pos:job.pos + n])[None], cache=job.cache)
                mx.eval([c.state for c in job.cache])
                job.pos += n
        except Exception as e:
            del self.prefilling[rid]
            up = u(rid)
            up.finish, up.error = "error", f"prefill failed: {type(e).__name__}: {e}"
            return 0
        u(rid).prefill_done = job.pos
        if job.pos >= len(ids) - 1:
            del self.prefilling[rid]
            if self.prefix is not None and job.pos > 0:
                self.prefix.add(ids[:job.pos], job.cache)
            self.ready.append(job)
        return max(n, 0)

    # -- reading back --------------------------------------------------------------
    def _read(self, inflight, u) -> int:
        ids, tokens, lp = inflight
        toks = tokens.tolist()  # the one host sync per step
        lps = None
        if lp is not None:
            want, chosen, top_ids, top_lp = lp
            chosen = chosen.tolist()
            top_ids = top_ids.tolist() if top_ids is not None else None
            top_lp = top_lp.tolist() if top_lp is not None else None
            lps = {}
            for j, i in enumerate(want):
                k = self.rows[ids[i]].params.logprobs if ids[i] in self.rows else 0
                lps[i] = {"logprob": chosen[j],
                          "top": list(zip(top_ids[j][:k], top_lp[j][:k])) if top_ids else []}
        emitted = 0
        for i, rid in enumerate(ids):
            r = self.rows.get(rid)
            if r is None or rid in self.drop:
                continue
            emitted += 1
            self._accept(r, toks[i], None if lps is None else lps.get(i), u(rid))
            if u(rid).finish is not None:
                self.drop.add(rid)
            if u(rid).finish is not None and rid not in self.ids:
                self.rows.pop(rid, None)
                self.drop.discard(rid)
        return emitted

    def _accept(self, r: _Decode, tok: int, lp: Optional[dict], up: RowUpdate):
        if tok in self.eos:
            r.detok.finalize()
            self._emit(r, up, final=True)
            up.finish = "stop"
            return
        r.ntok += 1
        up.tokens.append(tok)
        if lp is not None:
            lp["token"] = tok
            up.logprobs = (up.logprobs or []) + [lp]
        r.detok.add_token(tok)
        final = r.ntok >= r.params.max_tokens
        if final:
            r.detok.finalize()
        r.text += r.detok.last_segment
        try:
            hit = self._find_stop(r)
        except Exception as e:  # a stop callback's failure ends its row only
            up.finish, up.error = "error", f"stop callback failed: {type(e).__name__}: {e}"
            return
        if hit is not None:
            r.text = r.text[:hit]
            self._emit(r, up, final=True)
            up.finish = "stop"
            return
        self._emit(r, up, final)
        if final:
            up.finish = "length"

    def _find_stop(self, r: _Decode) -> Optional[int]:
        start = max(0, r.shown - r.hold)
        best = None
        for s in r.params.stop:
            if callable(s):
                if s(r.text):
                    return len(r.text)
                continue
            j = r.text.find(s, start)
            if j >= 0 and (best is None or j < best):
                best = j
        return best

    def _emit(self, r: _Decode, up: RowUpdate, final: bool):
        # Hold back a tail that could still become a stop string.
        end = len(r.text) if final or not r.hold else max(r.shown, len(r.text) - r.hold + 1)
        if end > r.shown:
            up.text += r.text[r.shown:end]
            r.shown = end

    # -- memory ----------------------------------------------------------------------
    def _kv_report(self):
        per_row: Dict[int, int] = {}
        total = 0
        if self.caches is not None and self.ids:
            batch = sum(c.nbytes for c in self.caches)
            total += batch
            for rid in self.ids:
                per_row[rid] = batch // len(self.ids)
        for rid, job in self.prefilling.items():
            b = sum(c.nbytes for c in job.cache if c.keys is not None)
            per_row[rid] = b
            total += b
        for job in self.ready:
            b = sum(c.nbytes for c in job.cache if c.keys is not None)
            per_row[job.admit.row_id] = b
            total += b
        return total, per_row

    def close(self):
        self.prefilling.clear()
        self.ready = []
        self._reset_batch()
        if self.prefix is not None:
            self.prefix.clear()
        mx.clear_cache()
