"""How a prompt becomes a queued row, on the loop: its parameters checked, its
prompt encoded, its constraint compiled (a row whose compile is still running is
held until it is ready), then the scheduler's queue. `Engine` mixes this in.
"""

from __future__ import annotations

import dataclasses
import secrets
import weakref
from typing import Iterable, List, Optional

from .. import _aio
from .constrain import SUBMIT_WAIT_S
from .prompts import WontFit, encode, sampling_params
from .rows import Row
from .run import Run
from .states import Finish

__all__ = ["Submitting"]


class Submitting:
    """The engine's submitting side (its queue, constraints and rows are `Engine`'s)."""

    def encode(self, prompt: str, chat: bool = True, system: Optional[str] = None) -> List[int]:
        """The prompt's token ids as the model will see them (prompts.py)."""
        self._check_open()
        return encode(self.tokenizer, prompt, chat, system, self.context_length,
                      self.max_prompt_chars)

    def prepare(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
                **params):
        """Validate and tokenize without submitting: (ids, SamplingParams). Raises
        ValueError with a one-line message for anything that cannot run."""
        self._check_open()
        sp = sampling_params(params)
        if "speculate" not in params and self.speculate is not None:
            sp = dataclasses.replace(sp, speculate=self.speculate)
        if sp.speculate == "draft" and self.draft_model is None:
            raise ValueError("speculate='draft' needs an engine with a draft model: "
                             "Engine(model, draft_model=...) or %mlxnb load MODEL "
                             "--draft DRAFT; or use speculate='lookup'")
        # a bad schema/regex/grammar raises here; one still compiling after
        # SUBMIT_WAIT_S holds its rows in the queue until it is ready (_enqueue)
        self.constraints.validate(sp, wait=SUBMIT_WAIT_S)
        self._check_adapter(sp.adapter)
        try:
            ids = self._fitting(prompt, chat, system, sp)
        except WontFit as e:
            e.params = sp
            raise
        if sp.seed is None and sp.temperature > 0:
            sp = dataclasses.replace(sp, seed=secrets.randbits(31))
        return ids, sp

    def _fitting(self, prompt, chat, system, sp) -> list:
        """The prompt's token ids; WontFit if it cannot fit the context or budget."""
        ids = self.encode(prompt, chat, system)
        if not ids:  # a row with no tokens would sit in 'prefill' forever
            raise ValueError("the prompt encodes to no tokens (the tokenizer drops all of "
                             "its characters); write some text to generate from")
        ctx = self.context_length
        msg = (f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
               f"model's context of {ctx}; shorten one of them"
               if ctx and len(ids) + sp.max_tokens > ctx else
               self.scheduler.never_fits(len(ids), sp.max_tokens))
        if msg:
            e = WontFit(msg)
            e.ids = ids  # (the ended row still counts its prompt's tokens)
            raise e
        return ids

    def submit(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
               tag=None, **params) -> Row:
        """Queue one prompt; returns its `Row` at once (await it for the result).

        Bad parameters raise ValueError. A row that can never fit the KV budget or
        the context is returned already ended with finish_reason 'error'.
        """
        self._check_open()
        try:
            ids, sp = self.prepare(prompt, chat=chat, system=system, **params)
            err = None
        except WontFit as e:
            err, ids, sp = str(e), getattr(e, "ids", []), e.params
        return self.submit_prepared(prompt, ids, sp, tag, err)

    def submit_prepared(self, prompt, ids, sp, tag=None, err=None) -> Row:
        """Submit what `prepare` returned (the magics validate a whole grid first)."""
        self._check_open()
        if self.loop is None:
            self.loop = _aio.engine_loop()  # the running (or kernel's) loop, else refuse
        if self.loop.is_closed():
            raise _aio.NoLoopError("this Engine's event loop is closed; create a new Engine")
        row = Row(next(self._ids), prompt, ids, sp, tag, future=self.loop.create_future(),
                  t0=self._t0, canceller=weakref.WeakMethod(self.cancel))
        pending = self.constraints.pending(sp) if err is None else None
        if pending is not None and pending.done():
            err, pending = (str(pending.exception() or "") or None), None
        self._live[row.id] = row
        try:
            _aio.call_soon(self.loop, self._enqueue, row, err, pending)
        except _aio.NoLoopError:
            self._live.pop(row.id, None)
            raise
        return row

    def generate(self, prompts: Iterable[str], *, chat: bool = True,
                 system: Optional[str] = None, **params) -> Run:
        """Submit several prompts as one `Run` (awaitable -> list of results)."""
        prompts = list(prompts)
        prepared = [self.prepare(p, chat=chat, system=system, **dict(params)) for p in prompts]
        run = Run([self.submit_prepared(p, ids, sp) for p, (ids, sp) in
                   zip(prompts, prepared)], meta={"model": self.model_name, "chat": bool(chat),
                                                 "system": system or None})
        used = {sp.adapter for _, sp in prepared} - {None}
        if used:
            run.meta["adapters"] = {n: self._adapters[n].path for n in sorted(used)}
        return run

    def _enqueue(self, row: Row, err: Optional[str] = None, pending=None):
        self._nsubmitted += 1
        if row.done:  # cancelled before it reached the loop
            return
        if err or self._shutting:
            self._notify("submit", row)
            self._end(row, Finish.ERROR if err else Finish.CANCELLED, err)
            return
        if pending is not None:  # its constraint is still compiling (constrain.py)
            self._held[row.id] = row
            self._notify("submit", row)
            pending.add_done_callback(lambda f: self._compiled(row, f))
            return
        self.scheduler.enqueue(row)
        self._notify("submit", row)
        self._serve_soon()

    def _compiled(self, row: Row, fut) -> None:
        """(On the compile's thread.) Hand a held row back to the loop."""
        try:
            _aio.call_soon(self.loop, self._release_held, row, fut)
        except _aio.NoLoopError:  # the loop is gone: nothing serves this row any more
            pass

    def _release_held(self, row: Row, fut) -> None:
        if self._held.pop(row.id, None) is None or row.done:
            return
        err = fut.exception()
        unfit = None if err is not None or self._closed else self.unfit(row)
        if err is not None or self._closed or unfit:
            self._end(row, Finish.CANCELLED if self._closed and not err else Finish.ERROR,
                      str(err) if err else unfit)
        else:
            self.scheduler.enqueue(row)
            self._serve_soon()

    def _serve_soon(self) -> None:
        self._ensure_task()
        self._wake.set()
        self._interrupt.set()
