"""What a submitted prompt is: its parameters, its live progress, its result.

A `Row` is created on the event loop by `Engine.submit` and is only ever mutated
there (the worker thread hands back plain values; the engine applies them), so
readers on the loop -- the widget, the magics -- never see a half-updated row.
"""

from __future__ import annotations

import asyncio
import copy
import math
import numbers
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, List, Optional

from .._aio import awaitable_on, call_soon
from .._log import swallowed
from .._text import RANGES, one_line
from .constraint_params import check_params as check_constraint, kind_of
from .constraint_results import parse_json
from .rowtrace import phases
from .states import Finish, RowState

QUEUED, PREFILL, DECODE, DONE = RowState


def _refuse(msg: str):
    raise ValueError(msg)


@dataclass(frozen=True)
class SamplingParams:
    """Per-row generation parameters (validated by `check`)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple = ()
    logprobs: int = 0
    logits_processors: tuple = ()
    # at most one constraint per row (constrain.py)
    json_schema: Optional[dict] = None
    regex: Optional[str] = None
    choices: Optional[tuple] = None
    grammar: Optional[str] = None
    # speculative decoding (worker/speculate.py): None, "lookup" or "draft" (an
    # engine's draft model, worker/draft.py); drafts per step
    # (0: adaptive)
    speculate: Optional[str] = None
    num_draft: int = 0
    adapter: Optional[str] = None  # a loaded adapter's name (core/adapters.py); None: base

    def check(self) -> "SamplingParams":
        # Types first, so that a non-number gets a message naming its parameter (not
        # "'>=' not supported between ..."), a bool is not taken for an int
        # (logprobs=True would fail every row of the batch), and inf/nan are refused.
        # Other number types (numpy's, Fraction) become Python's: the batch builds
        # MLX arrays from them, which would refuse them there, failing every row.
        plain = {}
        for name in ("max_tokens", "top_k", "seed", "logprobs", "num_draft"):
            v = getattr(self, name)
            if v is None and name == "seed":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                _refuse(f"{name} must be an integer, got {one_line(repr(v), 60)}")
            plain[name] = int(v)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if v is None and name == "repetition_penalty":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                _refuse(f"{name} must be a finite number, got {one_line(repr(v), 60)}")
            plain[name] = float(v)
        return replace(self, **plain)._check_values()

    def _check_values(self) -> "SamplingParams":
        if any(not callable(p) for p in self.logits_processors):
            _refuse("logits_processors entries must be callables (tokens, logits) -> logits")
        for name, (ok, what) in RANGES.items():
            v = getattr(self, name, None)
            if v is not None and not ok(v):
                _refuse(f"{name} must be {what}, got {one_line(repr(v), 60)}")
        if any(not (callable(s) or (isinstance(s, str) and s)) for s in self.stop):
            _refuse("stop entries must be non-empty strings (or callables text -> bool)")
        if self.speculate not in (None, "lookup", "draft"):
            _refuse("speculate must be 'lookup', 'draft' or None, got "
                    f"{one_line(repr(self.speculate), 60)}")
        if self.adapter is not None and not isinstance(self.adapter, str):
            _refuse(f"adapter must be an adapter's name (a string) or None, got "
                f"{one_line(repr(self.adapter), 60)}")
        check_constraint(self)
        return self

    def as_dict(self) -> dict:
        """The parameters by name, logits processors left out. Shallow: a deep copy
        would copy whatever a processor or a stop callable holds (a second model's
        weights, say) and fail on what cannot be copied (a lock)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "logits_processors"}

    @property
    def filters(self) -> tuple:
        """The truncation filters; rows with equal filters are sampled together."""
        return (self.top_k, self.top_p, self.min_p)


@dataclass
class RowResult:
    """The finished row: what `await row` returns."""

    id: int
    prompt: str
    text: str
    tokens: List[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: Optional[float]
    tok_s: Optional[float]
    logprobs: Optional[List[dict]]
    error: Optional[str]
    seed: Optional[int]
    params: dict
    json: Any = None  # the text parsed as JSON (see Row.json)
    json_error: Optional[str] = None
    valid: Optional[bool] = None  # a constrained row's text satisfies its constraint
    constraint_error: Optional[str] = None  # why not, when it does not
    draft_proposed: int = 0  # speculation: drafts verified, and accepted
    draft_accepted: int = 0
    reasoning: Optional[str] = None  # a server's reasoning model: what it thought first

    def to_dict(self) -> dict:
        """The fields as a dict; `params` copied shallowly (a stop function may hold
        what cannot be copied, such as a lock)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name != "params"}
        d["params"] = dict(self.params)
        return d


async def _result_of(fut):
    return fut.result()


class Row:
    """A prompt in flight. Await it for a `RowResult`; read its live fields any time.

    Live fields: `state` (queued | prefill | decode | done), `tokens`, `text` (stop
    strings held back, never shown), `prefill_done` / `prompt_tokens`, `finish_reason`,
    and timeline stamps `t_submit`, `t_admit`, `t_first`, `t_done` (engine clock, s).

    A plain record: the engine's event loop writes every field (text arrives already
    decoded from the worker), so reading from any thread sees whole values. It keeps
    no hold on the engine: a finished row outlives its engine at the cost of its own
    fields only.
    """

    reasoning = ""  # what a reasoning model thought first (a server's rows set it)

    def __init__(self, row_id: int, prompt: str, prompt_ids: List[int],
                 params: SamplingParams, tag: Any = None, *, future: asyncio.Future,
                 t0: float, canceller: Optional[Callable] = None):
        self.id = row_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.tag = tag  # free slot for the caller (e.g. the magic's sweep values)
        self.state = QUEUED
        self.tokens: List[int] = []
        self.text = ""  # the generated text so far, without stop strings
        self.logprobs: Optional[List[dict]] = [] if params.logprobs else None
        self.prefill_done = 0
        self.cached_tokens = 0
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        # a constrained row that ended stop/length: why its text breaks its
        # constraint (None: it satisfies it); set by the engine as the row ends
        self.constraint_error: Optional[str] = None
        # speculation: drafts verified for this row, how many it accepted, and which
        # of its tokens (indices into `tokens`) came from accepted drafts
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.drafted: List[int] = []
        self.drafted_spans: List[List[int]] = []  # [start, end) of `text` they showed
        self._t0 = t0  # the engine clock's origin (perf_counter)
        self.t_submit = time.perf_counter() - t0
        self.t_admit: Optional[float] = None
        self.t_first: Optional[float] = None
        self.t_done: Optional[float] = None
        self._future = future
        self._canceller = canceller  # weak: cancels through the engine while it lives
        self._callbacks: List[Callable[["Row"], None]] = []
        self._events: List[tuple] = []  # what the engine saw happen (rowtrace.py)

    # -- reading ---------------------------------------------------------------
    @property
    def trace(self) -> List[dict]:
        """The row's life as phase records: queued (and why), prefix hit, each
        prefill chunk, first token, decode, finish (rowtrace.py)."""
        return phases(self)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def ntok(self) -> int:
        return len(self.tokens)

    @property
    def json(self) -> Any:
        """The finished text parsed as JSON, or None (`json_error` says why)."""
        return parse_json(self)[0]

    @property
    def json_error(self) -> Optional[str]:
        return parse_json(self)[1]

    @property
    def valid(self) -> Optional[bool]:
        """A finished constrained row: does its text satisfy its constraint? (None
        for free rows, unfinished rows, and rows that ended in error or cancelled.)"""
        if (not self.done or kind_of(self.params) is None
                or self.finish_reason not in (Finish.STOP, Finish.LENGTH)):
            return None
        return self.constraint_error is None

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def tok_s(self) -> Optional[float]:
        """Decode rate after the first token (the first one is the prefill's)."""
        if self.t_first is None or len(self.tokens) < 2:
            return None
        end = self.t_done if self.t_done is not None else time.perf_counter() - self._t0
        return (len(self.tokens) - 1) / max(end - self.t_first, 1e-9)

    def result(self) -> RowResult:
        if not self.done:
            raise RuntimeError(f"row {self.id} is still {self.state}; await it first")
        p = self.params
        return RowResult(
            id=self.id, prompt=self.prompt, text=self.text, tokens=list(self.tokens),
            finish_reason=self.finish_reason, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, ttft_s=self.ttft_s, tok_s=self.tok_s,
            logprobs=self.logprobs, error=self.error, seed=p.seed,
            params=p.as_dict(),
            json=self.json, json_error=self.json_error, valid=self.valid,
            constraint_error=self.constraint_error,
            draft_proposed=self.draft_proposed, draft_accepted=self.draft_accepted,
            reasoning=self.reasoning or None,
        )

    def __await__(self):
        # Shielded: a cancelled awaiting cell must not cancel the row itself.
        fut = self._future
        if fut.done():  # its result, from any loop (the engine's may be closed by now)
            return _result_of(fut).__await__()
        return awaitable_on(fut.get_loop(), lambda: asyncio.shield(fut)).__await__()

    def add_done_callback(self, fn: Callable[["Row"], None]) -> None:
        """fn(row) once the row has ended, on the engine's loop (at once if it has
        ended and the caller is there). From another thread the check and the append
        go to the loop together, so an end in between cannot skip fn."""
        call_soon(self._future.get_loop(), self._add_done_callback, fn)

    def _add_done_callback(self, fn) -> None:
        if self.done:
            fn(self)
        else:
            self._callbacks.append(fn)

    # -- acting ----------------------------------------------------------------
    def cancel(self) -> None:
        """Stop this row at the next step boundary; it ends with 'cancelled'."""
        cancel = self._canceller() if self._canceller is not None else None
        if cancel is not None and not self.done:  # a gone engine ended all its rows
            cancel([self])

    def __repr__(self):
        extra = f" {self.finish_reason}" if self.done else ""
        return f"<Row {self.id} {self.state}{extra} ntok={self.ntok} {self.prompt[:30]!r}>"

    # -- the engine's side (on its loop) ------------------------------------------
    def mark_drafted(self, start: int, end: int) -> None:
        spans = self.drafted_spans
        if spans and spans[-1][1] == start:
            spans[-1] = [spans[-1][0], end]  # a new list: readers see old or new
        else:
            spans.append([start, end])

    def _finish(self, reason: Finish, error: Optional[str] = None) -> None:
        """Record the end: the last fields, the awaited result, the callbacks."""
        if self.done:
            return
        if error is not None:  # (a callback's own words: JSON, a widget, a file take it)
            error = error.encode("utf-8", "backslashreplace").decode("utf-8")
        # the state last: a reader on another thread that sees a done row sees its end
        self.finish_reason, self.error = reason, error
        self.t_done = time.perf_counter() - self._t0
        self.state = DONE
        if not self._future.done():
            try:
                self._future.set_result(self.result())
            except RuntimeError:  # its loop is closed (interpreter exit): nobody waits
                pass
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except (Exception, asyncio.CancelledError, SystemExit, GeneratorExit):
                # a caller's callback must not break the engine (an interrupt still does)
                swallowed("row callback", fn)


SPLIT_PARTS = ("build", "launch", "device", "worker", "loop")


class StepRecord:
    """One scheduler iteration, as the charts plot it.

    step, t (engine clock at the step's end, s), dt_s, batch_size (rows decoded),
    prefill_tokens, kv_bytes (real bytes held by all live KV caches), row_kv_bytes
    ({row_id: bytes}, computed on access: in a padded batch every row holds an equal
    share, so a step stores only the batch's row ids, shared between steps), tokens
    (tokens emitted this step), batch_ids (rows in the decode batch), prefill_rows
    ({row_id: prompt tokens prefilled this step}), ended (rows that ended this step),
    split (seconds: graph build, launch, waiting on the device, the worker's own
    bookkeeping, the engine loop's share), kv_budget (bytes or None), drafted /
    accepted (draft tokens a speculative step verified, and how many the rows took).
    """

    __slots__ = ("step", "t", "dt_s", "batch_size", "prefill_tokens", "kv_bytes",
                 "_batch_ids", "_share", "_prefill", "tokens", "prefill_rows", "ended",
                 "split", "kv_budget", "drafted", "accepted")

    def __init__(self, step, t, dt_s, batch_size, prefill_tokens, kv_bytes,
                 batch_ids=(), share=0, prefill_bytes=None, tokens=0, *,
                 prefill_rows=None, ended=(), split=(), kv_budget=None, drafted=0,
                 accepted=0):
        self.step, self.t, self.dt_s = step, t, dt_s
        self.batch_size, self.prefill_tokens, self.kv_bytes = batch_size, prefill_tokens, kv_bytes
        self._batch_ids, self._share, self._prefill = batch_ids, share, prefill_bytes or {}
        self.tokens = tokens
        self.prefill_rows, self.ended = prefill_rows or {}, ended
        self.split, self.kv_budget = split, kv_budget
        self.drafted, self.accepted = drafted, accepted

    @property
    def batch_ids(self) -> tuple:
        return tuple(self._batch_ids)

    @property
    def row_kv_bytes(self) -> dict:
        d = dict.fromkeys(self._batch_ids, self._share)
        d.update(self._prefill)
        return d

    def to_dict(self) -> dict:
        return {"step": self.step, "t": self.t, "dt_s": self.dt_s,
                "batch_size": self.batch_size, "prefill_tokens": self.prefill_tokens,
                "kv_bytes": self.kv_bytes, "tokens": self.tokens,
                "drafted": self.drafted, "accepted": self.accepted,
                "row_kv_bytes": {str(k): v for k, v in self.row_kv_bytes.items()},
                "batch_ids": list(self._batch_ids),
                "prefill_rows": {str(k): v for k, v in self.prefill_rows.items()},
                "ended": list(self.ended), "kv_budget": self.kv_budget,
                "split": dict(zip(SPLIT_PARTS, self.split))}

    def __repr__(self):
        return (f"StepRecord(step={self.step}, t={self.t:.3f}, dt_s={self.dt_s:.4f}, "
                f"batch_size={self.batch_size}, prefill_tokens={self.prefill_tokens}, "
                f"kv_bytes={self.kv_bytes}, tokens={self.tokens})")
