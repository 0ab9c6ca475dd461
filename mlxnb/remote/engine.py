"""`RemoteEngine`: the engine surface (`EngineLike`) over an OpenAI-compatible server.

    loop (kernel's event loop)
    --------------------------
    submit() -> RemoteRow, FIFO queue
    _pump(): while fewer than max_concurrency streams are open, start one task per row
    _stream_row(): POST /v1/chat/completions (or /v1/completions with --raw), read SSE,
                   text and counts straight into the row
    _sampler(): every `sample_s` while rows are live, one StepRecord: tokens received,
                mean gap between a stream's tokens, and the server's /metrics gauges

The server batches; we only decide how many requests are open at once. Everything
runs on the loop (no threads), so rows are only ever mutated there.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections import deque
from typing import Callable, Iterable, List, Optional, Sequence

from .. import _aio
from .._text import one_line
from ..core.rows import DECODE, PREFILL, Row, StepRecord
from ..core.prompts import check_text, sampling_params
from ..core.protocol import HeldRows, Listeners
from ..core.run import Run
from ..core.states import Finish
from . import wire
from .client import Client, EndStream, check_timeout, model_list_text
from .metrics import ServerLoad, server_load
from .row import RemoteRow
from .wire import Request, ServerError

_KEEP_STEPS = 200_000


class RemoteEngine(HeldRows, Listeners):
    """Rows served by an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server,
    mlx_lm.server ...). Build it with `mlxnb.connect(url)`; it has the local engine's
    surface, so `%%generate`, `Run`, the widget and `%mlxnb status/stop` work on it
    unchanged. `max_concurrency`: most requests open at once (the server batches
    them; more wait here, in order)."""

    kv_budget = None

    def __init__(self, url: str, model: Optional[str] = None, api_key: Optional[str] = None,
                 max_concurrency: int = 64, *, timeout: float = 60.0, retries: int = 5,
                 sample_s: float = 0.25, loop=None, _transport=None):
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) \
                or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive integer, got "
                             f"{max_concurrency!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        timeout = check_timeout(timeout)
        self.client = Client(url, api_key, max_connections=max_concurrency, timeout=timeout,
                             retries=retries, transport=_transport)
        self.url = self.client.shown  # no user:password@
        models, metrics_text = self.client.probe()
        if model is None and models and len(models) > 1:
            raise ValueError(f"the server serves {len(models)} models "
                             f"({model_list_text(models)}); pick one with --model NAME")
        if model is not None and models and model not in models:
            raise ValueError(f"the server does not serve model {model!r}; it lists "
                             f"{model_list_text(models)}; pass one of them as --model")
        self.model = model if model is not None else (models[0] if models else None)
        self.model_name = self.model or f"{self.url} (server's default model)"
        self.models = models
        load = server_load(metrics_text) if metrics_text else ServerLoad()
        self._metrics = load.reported
        self.metrics_source = load.source
        self.kv_unit = "fraction" if load.kv_fraction is not None else None
        self.batch_reported = load.running is not None
        self.load = load
        self.max_batch = max_concurrency
        self.sample_s = sample_s
        # None until the first submit when built on a plain thread (as the local
        # Engine: `await asyncio.to_thread(mlxnb.connect, url)` binds the caller's loop)
        self.loop = _aio.engine_loop(loop, required=False)
        self._t0 = time.perf_counter()
        self._ids = itertools.count()
        self._hold_rows()  # rows, submitted, finished (core/protocol.HeldRows)
        self.steps: List[StepRecord] = []
        self._queue: deque = deque()
        self._tasks = {}  # row id -> task streaming it
        self._listeners: List[Callable] = []
        self._sampler_task = None
        self._nsteps = 0
        self._tick_tokens = 0
        self._gap_sum, self._gap_n = 0.0, 0
        self._closed = False

    # -- state -------------------------------------------------------------------------
    def clock(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def running(self) -> int:
        return len(self._tasks)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine is closed; connect again")

    # -- submitting --------------------------------------------------------------------
    def prepare(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
                **params):
        """Validate without submitting: (Request, SamplingParams). ValueError (one
        line) for anything that cannot be sent."""
        if params.get("logits_processors"):
            raise ValueError("logits_processors run on the model in this process; a "
                             "remote server cannot take them (use `%mlxnb load` for that)")
        given = [k for k in ("json_schema", "regex", "choices", "grammar")
                 if params.get(k) is not None]
        if given:  # sent nowhere, they would leave the rows unconstrained without a word
            raise ValueError(f"{given[0]}= constrains tokens on a model in this process; a "
                             "remote server does not take it here (use `%mlxnb load`)")
        if params.get("speculate") is not None or params.get("num_draft"):
            raise ValueError("speculate= and num_draft= draft tokens on a model in this "
                             "process; a server speculates as it was started (use "
                             "`%mlxnb load` for mlxnb's own)")
        sp = sampling_params(params)
        for what, text in [("stop string", s) for s in sp.stop if isinstance(s, str)] + [
                ("adapter name", sp.adapter)]:
            try:  # (httpx would fail to encode the request body)
                text is None or text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"the {what} holds invalid unicode (lone surrogates); "
                                 "clean the text before submitting") from None
        if sp.adapter is not None and self.models and sp.adapter not in self.models:
            # servers serve adapters by model name (vLLM --lora-modules NAME=PATH)
            raise ValueError(f"the server does not serve adapter {sp.adapter!r} by name; "
                             f"it lists {model_list_text(self.models)} (start vLLM with "
                             f"--enable-lora --lora-modules {sp.adapter}=PATH)")
        if any(callable(s) for s in sp.stop):
            raise ValueError("a remote server takes stop strings only, not callables")
        check_text(prompt, system)
        return Request(bool(chat), system or None), sp

    def submit(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
               tag=None, **params) -> Row:
        """Queue one prompt; returns its row at once (await it for the result)."""
        self._check_open()
        req, sp = self.prepare(prompt, chat=chat, system=system, **params)
        return self.submit_prepared(prompt, req, sp, tag)

    def submit_prepared(self, prompt, prepared, sp, tag=None, err=None) -> Row:
        self._check_open()
        if self.loop is None:
            self.loop = _aio.engine_loop()  # the running (or kernel's) loop, else refuse
        row = RemoteRow(self, next(self._ids), prompt, prepared, sp, tag)
        self._live[row.id] = row
        self._nsubmitted += 1
        if err:
            self._notify("submit", row)
            self._end(row, Finish.ERROR, err)
            return row
        self._call_on_loop(self._enqueue, row)
        return row

    def generate(self, prompts: Iterable[str], *, chat: bool = True,
                 system: Optional[str] = None, **params) -> Run:
        prompts = list(prompts)
        prepared = [self.prepare(p, chat=chat, system=system, **dict(params)) for p in prompts]
        return Run([self.submit_prepared(p, req, sp) for p, (req, sp) in zip(prompts, prepared)],
                   meta={"model": self.model_name, "server": self.url,
                         "chat": bool(chat), "system": system or None})

    def _call_on_loop(self, fn, *args):
        if self.loop is None:  # nothing submitted yet: no row is bound to a loop
            fn(*args)
            return
        _aio.call_soon(self.loop, fn, *args)  # subshell threads hop onto the loop

    def _enqueue(self, row):
        if row.done:
            return
        if self._closed:  # closed after its submit checked: it ends, not vanishes
            self._notify("submit", row)
            self._end(row, Finish.CANCELLED)
            return
        self._queue.append(row)
        self._notify("submit", row)
        self._pump()

    def _pump(self):
        while self._queue and len(self._tasks) < self.max_batch and not self._closed:
            row = self._queue.popleft()
            if row.done:
                continue
            # A fresh context: output from these tasks must not be tied to the cell
            # that happened to start them (as the local engine's serving task).
            task = self.loop.create_task(self._stream_row(row),
                                         context=contextvars.Context())
            task.add_done_callback(lambda _, row=row: self._streamed(row))
            self._tasks[row.id] = task
        if self._tasks and (self._sampler_task is None or self._sampler_task.done()):
            self._sampler_task = self.loop.create_task(self._sampler(),
                                                       context=contextvars.Context())

    # -- one request ---------------------------------------------------------------------
    async def _stream_row(self, row: RemoteRow):
        req = row.request
        path = "/chat/completions" if req.chat else "/completions"
        row.state, row.t_admit = PREFILL, self.clock()
        try:
            # a row's adapter goes out as the request's model (vLLM's LoRA modules)
            await self.client.stream(path, wire.request_body(row.prompt, req, row.params,
                                                             row.params.adapter or self.model),
                                     lambda obj: self._on_data(row, obj),
                                     lambda text: self._on_comment(row, text))
            if row._capped:
                self._end(row, Finish.LENGTH)
            else:
                self._end(row, *wire.finish(row._server_finish))
        except asyncio.CancelledError:
            self._end(row, Finish.CANCELLED)
        except ServerError as e:
            if row._server_finish is not None:
                # the server had said how the row ended: a break after that (before
                # [DONE]) loses nothing of it
                self._end(row, *wire.finish(row._server_finish))
            else:
                self._end(row, Finish.ERROR, one_line(self.client.scrub(str(e)), 600))
        except Exception as e:  # a bug here must end this row only
            self._end(row, Finish.ERROR,
                      one_line(self.client.scrub(f"{type(e).__name__}: {e}"), 600))

    def _streamed(self, row: RemoteRow):
        """A row's task is over: free its slot, start the next. A task cancelled before
        it first ran never entered _stream_row, so its row may not have ended yet."""
        self._tasks.pop(row.id, None)
        self._end(row, Finish.CANCELLED)
        self._pump()

    def _on_comment(self, row: RemoteRow, text: str) -> bool:
        """Apply one comment; True when it reported prefill progress (a long prompt
        is being read, which counts as the server working on the row)."""
        progress = wire.prefill_progress(text)
        if progress is not None and row.state == PREFILL:
            moved = progress[0] > row.prefill_done
            row.prefill_done, row._prompt_n = progress
            return moved
        return False

    def _on_data(self, row: RemoteRow, obj) -> bool:
        """Apply one event to its row; True when it carried output."""
        ev = wire.parse_event(obj, row.request.chat)
        if ev.ntok and row._ntok >= row.params.max_tokens:
            # A server that ignores max_tokens would stream on until stopped by hand.
            row._capped = True
            raise EndStream
        if ev.ntok:
            now = self.clock()
            if row.t_first is None:
                row.t_first, row.state, row.prefill_done = now, DECODE, row._prompt_n
            elif row._t_last is not None:
                self._gap_sum += now - row._t_last
                self._gap_n += ev.ntok
            row._t_last = now
            row._ntok += ev.ntok
            self._tick_tokens += ev.ntok
            row.text += ev.text
            row.reasoning += ev.reasoning
            if ev.logprobs and row.logprobs is not None:
                row.logprobs.extend(ev.logprobs)
        if ev.finish:
            row._server_finish = ev.finish
        if ev.usage:  # the server's own counts are the truth for the row
            prompt, completion, row.cached_tokens = wire.usage_counts(ev.usage)
            row._prompt_n = prompt if prompt is not None else row._prompt_n
            if completion is not None and completion >= row._ntok:
                self._tick_tokens += completion - row._ntok
                row._ntok = completion
        return ev.ntok > 0

    def _end(self, row: Row, reason: str, error: Optional[str] = None):
        if row.done:
            return
        self._live.pop(row.id, None)
        self._stopping.discard(row.id)
        self._finished[row.id] = row
        self.finished[reason] += 1
        row._finish(reason, error)
        self._notify("finish", row)

    # -- charts ----------------------------------------------------------------------------
    async def _sampler(self):
        """One StepRecord per `sample_s` in which tokens arrived: the tokens, the mean
        gap between a stream's consecutive tokens (a batching server's step time, as
        seen from here) and the server's gauges when it publishes them."""
        t_prev = self.clock()
        while self._tasks and not self._closed:
            await asyncio.sleep(self.sample_s)
            if self._metrics:
                text = await self.client.get_text("/metrics")
                if text is not None:
                    self.load = server_load(text)
            now = self.clock()
            toks, self._tick_tokens = self._tick_tokens, 0
            gap = self._gap_sum / self._gap_n if self._gap_n else now - t_prev
            self._gap_sum, self._gap_n = 0.0, 0
            if toks:
                self._record(now, gap, toks)
            t_prev = now

    def _record(self, now, dt, toks):
        ld = self.load
        rec = StepRecord(self._nsteps, now, dt,
                         int(ld.running) if ld.running is not None else 0, 0,
                         ld.kv_fraction if ld.kv_fraction is not None else 0, tokens=toks)
        self._nsteps += 1
        self.steps.append(rec)
        if len(self.steps) > _KEEP_STEPS + _KEEP_STEPS // 16:
            del self.steps[:len(self.steps) - _KEEP_STEPS]
        self._notify("step", rec)

    # -- cancelling, waiting, closing ------------------------------------------------------
    def cancel(self, rows: Sequence[Row]) -> None:
        self._call_on_loop(self._cancel, list(rows))

    def cancel_all(self) -> None:
        self.cancel(list(self._live.values()))

    def _cancel(self, rows):
        for row in rows:
            if row.done:
                continue
            task = self._tasks.get(row.id)
            if task is not None:
                task.cancel()  # closes the stream: the server stops generating
                self._stopping.add(row.id)
            else:
                try:
                    self._queue.remove(row)
                except ValueError:
                    pass
                self._end(row, Finish.CANCELLED)

    async def wait(self) -> None:
        pending = [r._future for r in self._live.values()]
        if pending:
            await asyncio.shield(asyncio.gather(*pending))

    async def aclose(self) -> None:
        """Cancel what is queued or streaming (rows end 'cancelled'), close the pool."""
        if self._closed:
            return
        self.cancel_all()
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        self._shut()
        await self.client.aclose()

    def close(self) -> None:
        """Synchronous close, from any thread: no row is taken from now on; queued and
        streaming rows end 'cancelled' on the loop (at once when called there), and
        the pool closes there."""
        if self._closed:
            return
        self._closed = True
        # asyncio objects belong to the loop's thread
        if _aio.call_soon_or_here(self.loop, self._shut) and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self.loop)

    def _shut(self):
        self._closed = True
        self._queue.clear()
        for t in list(self._tasks.values()):  # (one submitted while aclose waited too)
            t.cancel()
        if self._sampler_task is not None:
            self._sampler_task.cancel()
        for row in list(self._live.values()):  # nothing is left without a finish reason
            self._end(row, Finish.CANCELLED)

    def status(self) -> str:
        done = sum(self.finished.values())
        ld = self.load
        if ld.reported:
            parts = [f"{n} {v:g}" for n, v in (("running", ld.running), ("waiting", ld.waiting))
                     if v is not None]
            if ld.kv_fraction is not None:
                parts.append(f"KV {100 * ld.kv_fraction:.0f}%")
            server = f"server ({ld.source} metrics): {', '.join(parts)}"
        else:
            server = "server load: not reported by this server"
        retried = f", {self.client.retried} retried" if self.client.retried else ""
        return (f"model {self.model_name} at {self.url} | streaming {self.running}, queued "
                f"{self.queued}, done {done} (max {self.max_batch} at once{retried}) | {server}")

    def __repr__(self):
        return f"<mlxnb.RemoteEngine {self.status()}>"

