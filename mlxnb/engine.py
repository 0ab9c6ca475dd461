"""`Engine`: the continuous-batching scheduler on an asyncio loop.

    loop thread (kernel's event loop)         worker thread (owns every MLX array)
    ---------------------------------         ------------------------------------
    submit() -> Row, queue (FIFO)
    _serve(): admit by policy  ── tick ──▶    BatchExecutor.tick(admits, cancels)
              apply RowUpdates ◀─ report ──   (prefill chunk, decode N+1, read N)
              StepRecord, listeners

mlx-lm's arrays live on thread-local streams, so one worker thread does all MLX work
(loading included) and the loop only ever sees plain Python values. The loop awaits
each tick, so it stays free to run cells, widget messages and stop buttons meanwhile.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence, Union

from . import progress
from .batch import Admit, BatchExecutor
from .constrain import normalize as normalize_constraint
from .caches import KV_BITS, KV_GROUP_SIZES
from .rows import PREFILL, Row, SamplingParams, StepRecord
from .run import Run
from ._log import log, swallowed
from ._text import fmt_bytes, parse_bytes
from .scheduler import Scheduler
from .warmup import warm_up

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


class _WontFit(ValueError):
    """A valid row that exceeds the context or KV budget; submit() returns it as an
    errored row. A type of its own, not a message match: other bad input naming
    "context" or "KV cache" (submit(context=1)) must still raise."""


# Longest run of decode steps the worker takes without the loop. Each round trip
# costs ~0.4 ms of host time the device waits for
# (bench/results/2026-11-29-h200-before-fusion.md); new rows and cancels end a streak
# at once (`_interrupt`), so it bounds only how often tokens reach the widget.
_STREAK_S = 0.050
_KEEP_STEPS = 200_000  # step records kept in `Engine.steps` (oldest dropped first)
_WORKER_TIDS: set = set()
_WORKER: Optional[ThreadPoolExecutor] = None
_WORKER_LOCK = threading.Lock()


def _mlx_worker() -> ThreadPoolExecutor:
    """The process's one MLX thread, shared by every Engine.

    MLX keeps streams and, on CUDA, its per-shape kernel state (cuDNN attention
    graphs, CUDA graphs, library handles) in thread-locals (`thread_local` across
    mlx/backend/cuda). With a thread per Engine every new Engine -- a re-run cell,
    `%mlxnb load` -- started cold: each prefill shape paid its 50-300 ms setup again
    (bench/results/2026-11-29-h200-diagnostics.md)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxnb-mlx")
            _WORKER_TIDS.add(_WORKER.submit(threading.get_native_id).result())
        return _WORKER


def _forget_worker():
    # A forked child inherits _WORKER but not its thread: without this, Engine()
    # there would hang on the first submit.
    global _WORKER
    _WORKER = None
    _WORKER_TIDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


@atexit.register
def _await_worker_exit():
    # MLX's thread-local destructors take the GIL as a thread exits; a worker still
    # exiting while the interpreter finalizes aborts the process ("terminate called
    # without an active exception", rc 134, ~10% of script runs). atexit runs after
    # the pool threads are joined, so wait (bounded) until their OS threads are gone.
    deadline = time.monotonic() + 2.0
    for tid in list(_WORKER_TIDS):
        while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.001)


def _get_loop(loop):
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:  # IPython kernel: the kernel's loop even before it runs (--ext at start)
        import tornado.ioloop

        return tornado.ioloop.IOLoop.current().asyncio_loop
    except Exception:
        return asyncio.get_event_loop_policy().get_event_loop()


class Engine:
    """Continuous-batching generation on one MLX model.

    `model`: "default" (bundled SmolLM2-135M-Instruct), an mlx-lm hub id, a local
    mlx-lm directory, or a `(model, tokenizer)` pair. `kv_budget`: bytes or "2GB" or
    None (no limit). `prefill_chunk`: prompt tokens prefilled per step beside running
    rows (their stall is bounded by one chunk); None adapts it to the device, about
    50 ms of prefill per step (512..8192 tokens). Construction blocks while the model
    loads and, with `warmup`, runs a few tokens through the common batch paths once
    (warmup.py: the first use of each kernel costs seconds on some backends, which
    the first rows would otherwise wait for; `warmup_s` says how long it took).
    `fuse`: concatenate each layer's q/k/v and gate/up projection weights so each
    group is one matmul (fuse.py; same outputs; bf16 decode steps 2-25% faster on
    an H200; quantized layers are left alone, where it measured no gain). It changes
    the model in place: a model you pass in then shows `q_k_v_fused` /
    `gate_up_fused` in its parameters; fuse=False leaves it as is.
    """

    def __init__(self, model="default", *, max_batch: int = 32,
                 kv_budget: Union[str, int, None] = "2GB",
                 prefill_chunk: Optional[int] = None,
                 prefix_cache: Union[str, int, None] = "256MB", warmup: bool = True,
                 fuse: bool = True, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64, loop=None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int)
                                          or isinstance(prefill_chunk, bool)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer or None (auto), "
                             f"got {prefill_chunk!r}")
        if kv_bits is not None and kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} or "
                             f"None (full-precision KV), got {kv_bits!r}")
        if kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of "
                             f"{', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}")
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.kv_budget = parse_bytes(kv_budget)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.loop = _get_loop(loop)
        self._t0 = time.perf_counter()
        self._pool = _mlx_worker()
        prefix_bytes = parse_bytes(prefix_cache) or 0 if prefix_cache else 0
        self.model_name = model if isinstance(model, str) else getattr(
            model[0], "model_type", type(model[0]).__name__)
        with progress.loading(self.model_name):
            self.model, self.tokenizer, self._exec, self.warmup_s = self._pool.submit(
                self._load, model, prefix_bytes, warmup, fuse).result()
        self.context_length = getattr(getattr(self.model, "args", None),
                                      "max_position_embeddings", None)
        self.scheduler = Scheduler(max_batch, self.kv_budget, self._exec.kv_bytes_for)
        self.rows: List[Row] = []
        self.steps: List[StepRecord] = []  # the latest _KEEP_STEPS steps
        self._nsteps = 0
        self._by_id = {}
        self._cancels: List[int] = []
        self._listeners: List[Callable] = []
        self._wake = asyncio.Event()
        self._interrupt = threading.Event()  # set on the loop: ends the worker's streak
        self._closed = False
        self._task = None
        self._idle: Optional[asyncio.Future] = None

    def _load(self, model, prefix_bytes, warmup, fuse):
        if isinstance(model, (tuple, list)):
            m, tok = model
        else:
            from .models import load_model

            m, tok = load_model(model)
        ex = BatchExecutor(m, tok, self.prefill_chunk, prefix_bytes, fuse,
                           self.kv_bits, self.kv_group_size)
        if warmup:
            progress.stage("warming up")
        return m, tok, ex, warm_up(ex) if warmup else 0.0

    @property
    def cache_kinds(self) -> str:
        """The model's layer caches as batched, e.g. '24 recurrent-state + 8
        attention layers, KV 4-bit'."""
        return self._exec.cache_kinds

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    # -- state -------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.scheduler.active)

    @property
    def queued(self) -> int:
        return len(self.scheduler.queue)

    def add_listener(self, fn: Callable) -> None:
        """fn(kind, obj) on the loop: ('submit', Row), ('step', StepRecord), ('finish', Row)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _notify(self, kind, obj):
        for fn in list(self._listeners):
            try:
                fn(kind, obj)
            except Exception:  # a listener's bug must not stop generation
                swallowed("engine listener", fn)

    # -- submitting ----------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = True, system: Optional[str] = None) -> List[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("the prompt is empty; write some text to generate from")
        try:
            prompt.encode("utf-8")
            # the system prompt too (tokenizers raise a TypeError on surrogates)
            if isinstance(system, str):
                system.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the prompt holds invalid unicode (lone surrogates); "
                             "clean the text before submitting") from None
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True))
        text = f"{system}\n\n{prompt}" if system else prompt
        return list(tok.encode(text))

    def prepare(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
                **params):
        """Validate and tokenize without submitting: (ids, SamplingParams). Raises
        ValueError with a one-line message for anything that cannot run."""
        unknown = set(params) - _PARAM_NAMES
        if unknown:
            raise ValueError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
        if params.get("stop") is None:
            params["stop"] = ()
        elif isinstance(params["stop"], str):
            params["stop"] = (params["stop"],)
        try:  # a non-iterable (stop=5) must give the message below, not a bare TypeError
            if not isinstance(params["stop"], tuple):
                params["stop"] = tuple(params["stop"])
            params["logits_processors"] = tuple(params.get("logits_processors") or ())
        except TypeError:
            raise ValueError("stop and logits_processors take a list (stop: strings or "
                             "callables text -> bool)") from None
        try:
            sp = SamplingParams(**normalize_constraint(params)).check()
        except TypeError as e:
            raise ValueError(str(e)) from None
        self._exec.constraints.validate(sp)  # a bad schema/regex/grammar raises here
        ids = self.encode(prompt, chat, system)
        if not ids:  # a row with no tokens would sit in 'prefill' forever
            raise ValueError("the prompt encodes to no tokens (the tokenizer drops all of "
                             "its characters); write some text to generate from")
        ctx = self.context_length
        if ctx and len(ids) + sp.max_tokens > ctx:
            raise _WontFit(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) "
                           f"exceeds the model's context of {ctx}; shorten one of them")
        msg = self.scheduler.never_fits(len(ids), sp.max_tokens)
        if msg:
            raise _WontFit(msg)
        if sp.seed is None and sp.temperature > 0:
            sp = dataclasses.replace(sp, seed=secrets.randbits(31))
        return ids, sp

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
        except _WontFit as e:
            err = str(e)
            ids, sp = [], SamplingParams(**{k: v for k, v in params.items()
                                            if k in _PARAM_NAMES and k != "stop"})
        return self.submit_prepared(prompt, ids, sp, tag, err)

    def submit_prepared(self, prompt, ids, sp, tag=None, err=None) -> Row:
        """Submit what `prepare` returned (the magics validate a whole grid first)."""
        self._check_open()
        row = Row(self, len(self.rows), prompt, ids, sp, tag)
        self.rows.append(row)
        self._by_id[row.id] = row
        if err:
            self._notify("submit", row)
            self._end(row, "error", err)
            return row
        self._call_on_loop(self._enqueue, row)
        return row

    def generate(self, prompts: Iterable[str], *, chat: bool = True,
                 system: Optional[str] = None, **params) -> Run:
        """Submit several prompts as one `Run` (awaitable -> list of results)."""
        prompts = list(prompts)
        prepared = [self.prepare(p, chat=chat, system=system, **dict(params)) for p in prompts]
        return Run([self.submit_prepared(p, ids, sp) for p, (ids, sp) in
                    zip(prompts, prepared)], meta={"model": self.model_name})

    def _enqueue(self, row: Row):
        if row.done:  # cancelled before it reached the loop
            return
        self.scheduler.enqueue(row)
        self._notify("submit", row)
        self._ensure_task()
        self._wake.set()
        self._interrupt.set()

    def _call_on_loop(self, fn, *args):
        if self._on_loop_thread():
            fn(*args)
        else:  # ipykernel subshells run cells on another thread
            self.loop.call_soon_threadsafe(fn, *args)

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return getattr(self.loop, "_thread_id", None) in (None, threading.get_ident())

    # -- cancelling ----------------------------------------------------------------
    def cancel(self, rows: Sequence[Row]) -> None:
        self._call_on_loop(self._cancel, list(rows))

    def cancel_all(self) -> None:
        self.cancel([r for r in self.rows if not r.done])

    def _cancel(self, rows):
        for row in rows:
            if row.done:
                continue
            if self.scheduler.dequeue(row):
                self._end(row, "cancelled")
            else:
                self._cancels.append(row.id)
        self._wake.set()
        self._interrupt.set()

    # -- the serving loop ----------------------------------------------------------
    def _ensure_task(self):
        if self._task is None or self._task.done():
            import contextvars

            # A fresh context: output from this long-lived task must not be tied to
            # the cell that happened to start it (ipykernel 7 sends a task's output
            # with the parent header of the cell that created it, even after it ends).
            self._task = self.loop.create_task(self._serve(), context=contextvars.Context())

    async def _serve(self):
        while not self._closed:
            admits = self.scheduler.admit()
            cancels, self._cancels = self._cancels, []
            if not (admits or cancels or self._exec.busy):
                self._wake.clear()
                if self._idle is not None and not self._idle.done():
                    self._idle.set_result(None)
                await self._wake.wait()
                continue
            now = self.clock()
            for row in admits:
                row.state, row.t_admit = PREFILL, now
            t0 = time.perf_counter()
            # Let the worker run decode steps back to back. Rows queued for room need
            # no shorter streak: room comes from a row finishing, which ends it.
            self._interrupt.clear()
            try:
                report = await self.loop.run_in_executor(
                    self._pool, self._exec.tick,
                    [Admit(r.id, r.prompt_ids, r.params) for r in admits], cancels,
                    _STREAK_S, self._interrupt)
            except Exception as e:  # the executor itself broke: fail what it held
                for rid in list(self.scheduler.active):
                    self._end(self._by_id[rid], "error", f"engine step failed: {e}")
                self._exec.close()
                continue
            self._apply(report, time.perf_counter() - t0)

    def _apply(self, report, dt):
        now = self.clock()
        by_id = self._by_id
        for rid, tok, text, lp in report.emitted:
            row = by_id[rid]
            if tok is not None:
                if row.t_first is None:
                    row.t_first = now
                row.tokens.append(tok)
                if lp is not None:
                    row.logprobs.append(lp)
            if text:
                row._text += text
        for rid, up in report.updates.items():
            row = by_id[rid]
            if row.done:
                continue
            if up.state:
                row.state = up.state
            if up.prefill_done is not None:
                row.prefill_done = up.prefill_done
            if up.cached_tokens is not None:
                row.cached_tokens = up.cached_tokens
            if up.finish:
                if row.t_first is None and up.finish == "stop":
                    row.t_first = now
                self._end(row, up.finish, up.error)
        # The first step also carries the loop's share of the round trip.
        worker = sum(st.seconds for st in report.steps)
        t = now - dt
        for i, st in enumerate(report.steps):
            secs = st.seconds + ((dt - worker) if i == 0 else 0.0)
            t += secs
            rec = StepRecord(self._nsteps, t, secs, st.decoded, st.prefill_tokens,
                             st.kv_bytes, st.batch_ids, st.batch_share, st.prefill_bytes,
                             st.read)
            self._nsteps += 1
            self.steps.append(rec)
            self._notify("step", rec)
        if len(self.steps) > _KEEP_STEPS + _KEEP_STEPS // 16:  # a kernel may run for days
            del self.steps[:len(self.steps) - _KEEP_STEPS]

    def _end(self, row: Row, reason: str, error: Optional[str] = None):
        self.scheduler.release(row.id)
        row._finish(reason, error)
        self._notify("finish", row)

    # -- waiting and closing ---------------------------------------------------------
    async def wait(self) -> None:
        """Wait until every submitted row has finished."""
        pending = [r._future for r in self.rows if not r.done]
        if pending:
            await asyncio.shield(asyncio.gather(*pending))

    async def aclose(self) -> None:
        """Cancel what is running, stop the scheduler and free the model's caches."""
        if self._closed:
            return
        self.cancel_all()
        if self._task is not None and not self._task.done():
            self._idle = self.loop.create_future()
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), timeout=10)
            except asyncio.TimeoutError:
                log.warning("aclose: the scheduler did not go idle within 10 s; closing anyway")
        self._closed = True
        self._wake.set()
        self._interrupt.set()
        for row in self.rows:  # nothing is ever left without a finish reason
            if not row.done:
                self._end(row, "cancelled")
        try:
            await self.loop.run_in_executor(self._pool, self._exec.close)
        except RuntimeError:  # interpreter shutdown already stopped the worker
            pass

    def close(self) -> None:
        """Synchronous close for scripts/atexit: cancel everything, free the caches."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._interrupt.set()
        for row in self.rows:
            if not row.done:
                self._end(row, "cancelled")
        try:  # after any tick in flight: the worker runs one thing at a time
            self._pool.submit(self._exec.close)
        except RuntimeError:  # interpreter shutdown already stopped the worker
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this Engine is closed; create a new one")

    def status(self) -> str:
        kv = self.steps[-1].kv_bytes if self.steps else 0
        budget = fmt_bytes(self.kv_budget) if self.kv_budget else "no limit"
        done = sum(r.done for r in self.rows)
        # a plain number the worker writes; a read mid-tick is at most one tick old
        chunk = self._exec.policy.current
        mode = "auto" if self.prefill_chunk is None else "fixed"
        prefix = "on" if self._exec.prefix is not None else (
            "off for these cache kinds" if self._exec.prefix_bytes else "off")
        return (f"model {self.model_name} | running {self.running}, queued {self.queued}, "
                f"done {done} | KV {fmt_bytes(kv)} / {budget} | prefill {chunk} "
                f"tokens/step ({mode}) | {self._exec.cache_kinds} | prefix reuse "
                f"{prefix}")

    def __repr__(self):
        return f"<mlxnb.Engine {self.status()}>"
