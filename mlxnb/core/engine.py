"""`Engine`: the continuous-batching scheduler on an asyncio loop.

    loop thread (kernel's event loop)         worker thread (owns every MLX array)
    ---------------------------------         ------------------------------------
    submit() -> Row, queue (FIFO)
    _serve(): admit by policy  ── tick ──▶    BatchExecutor.tick(admits, cancels)
              apply RowUpdates ◀─ report ──   (prefill chunk, decode N+1, read N)
              StepRecord, listeners

The threading rule is core/__init__.py's: the loop reads only what the worker hands
back (messages.py). The loop awaits each tick, so it stays free to run cells, widget
messages and stop buttons meanwhile.
Reading a model from disk or the hub never runs on that worker (it may block for
good): it runs on a thread of its own, bounded by `load_timeout` and interruptible,
and only the short set-up of the loaded arrays (fusing, warm-up) is queued on the
worker, one small job at a time, between other engines' ticks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

from .. import _aio
from .._log import Laps
from ..models import progress
from .constrain import Constraints
from .adapters import Adapters
from .closing import Closing
from .reports import Reports
from .submitting import Submitting
from .messages import Admit, WorkerState
from .options import check_options
from .states import Finish
from .worker.batch import BatchExecutor
from .worker.setup import row_kv_bytes
from .prompts import longest_token
from .protocol import HeldRows, Listeners
from .rows import PREFILL, Row, StepRecord
from . import rowtrace
from ._threads import LOAD_TIMEOUT_S, load_bounded, mlx_worker
from .._text import fmt_bytes, one_line, parse_bytes
from .scheduler import Scheduler
from .worker.warmup import warm_up


@dataclasses.dataclass
class _Failed:
    """A tick that raised, handed back as its value: whatever it raised (a user
    callback's SystemExit included) fails the rows it held, as any error does,
    while only asyncio's own exceptions come out of the await."""

    error: BaseException


def _failure_as_value(fn, *args):
    try:
        return fn(*args)
    except BaseException as e:  # (signals reach the main thread only: on the worker a
        return _Failed(e)       # KeyboardInterrupt is some callback's own raise)


def _admitted(rows: List[Row], now: float, waited_for) -> None:
    for row in rows:
        row.state, row.t_admit = PREFILL, now
        rowtrace.note_admitted(row, waited_for(row))


def _pair(model):
    """mlx_lm.load(..., return_config=True)'s (model, tokenizer, config) as the pair."""
    if isinstance(model, (tuple, list)) and len(model) == 3 and isinstance(model[2], dict):
        return tuple(model[:2])
    return model


class Engine(Submitting, HeldRows, Listeners, Closing, Adapters, Reports):
    """Continuous-batching generation on one MLX model.

    `model`: "default" (bundled SmolLM2-135M-Instruct), an mlx-lm hub id, a local
    mlx-lm directory, or a `(model, tokenizer)` pair (a `(model, tokenizer, config)`
    triple from `mlx_lm.load(..., return_config=True)` too). `kv_budget`: bytes or "2GB" or
    None (no limit). `prefix_cache`: bytes of prompt KV kept for rows that share a
    prefix, a cap of its own beside `kv_budget` (None: no reuse; `status()` shows
    what it holds). `prefill_chunk`: prompt tokens prefilled per step beside running
    rows (their stall is bounded by one chunk); None adapts it to the device, about
    50 ms of prefill per step (512..8192 tokens). Construction blocks while the model
    loads (at most `load_timeout` seconds, None: no limit; an interrupt stops the
    wait) and, with `warmup`, runs a few tokens through the common batch paths once
    (warmup.py: the first use of each kernel costs seconds on some backends, which
    the first rows would otherwise wait for; `warmup_s` says how long it took).
    Other engines keep generating meanwhile, between the set-up's jobs on the shared
    worker (each job a pause for their rows: fusing and probing the model, each
    warm-up tick, each prefill-rate run); build it from another thread (for example
    `await asyncio.to_thread(Engine, name)` in a notebook) to keep this loop free.
    `fuse`: concatenate each layer's q/k/v and gate/up projection weights (and a
    gated delta-net's input projections) so each group is one matmul (fuse.py; same
    outputs; bf16 decode steps 2-25% faster on
    an H200; quantized layers are left alone, where it measured no gain). It changes
    the model in place: a model you pass in then shows `q_k_v_fused` /
    `gate_up_fused` (`in_proj_fused`, `w1_w3_fused`) in its parameters; fuse=False leaves it as is.
    `streak_s`: the longest run of decode steps the worker takes without the loop
    (each round trip costs ~0.4 ms of host time the device waits for; new rows and
    cancels end a streak at once, so it bounds only how often tokens reach the
    widget; 0: one step per round trip). `fill_threads`: threads that fill
    structured rows' token masks while the forward launches (None: a quarter of the
    cores, 1 to 4).
    `loop`: the event loop rows are served on; by default the running one, else the
    IPython kernel's (from any thread), else the one running where rows are first
    submitted; a submit with no running loop to serve on is refused.

    Lifetime: `close()` / `await aclose()` cancel unfinished rows and release the
    model, its caches and the tokenizer. Rows, `Run`s and widgets keep what they show
    (text, tokens, stats) without keeping the engine alive; the engine itself keeps
    unfinished rows, and finished ones only while something else holds them.
    """

    def __init__(self, model="default", *, max_batch: int = 32,
                 kv_budget: Union[str, int, None] = "2GB",
                 prefill_chunk: Optional[int] = None,
                 prefix_cache: Union[str, int, None] = "256MB", warmup: bool = True,
                 fuse: bool = True, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64,
                 load_timeout: Optional[float] = LOAD_TIMEOUT_S,
                 streak_s: float = 0.050, fill_threads: Optional[int] = None, loop=None,
                 speculate: Optional[str] = None, draft_model=None):
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        model, draft_model = _pair(model), _pair(draft_model)
        if not isinstance(model, str) and not (isinstance(model, (tuple, list))
                                               and len(model) == 2):
            got = (f"a {type(model).__name__} of {len(model)}"
                   if isinstance(model, (tuple, list)) else type(model).__name__)
            raise ValueError(f"model takes a name, a path or a (model, tokenizer) pair; got "
                             f"{got} (a loaded model alone has no tokenizer: pass "
                             "(model, tokenizer))")
        check_options(max_batch=max_batch, prefill_chunk=prefill_chunk, kv_bits=kv_bits,
                      kv_group_size=kv_group_size, load_timeout=load_timeout,
                      streak_s=streak_s, fill_threads=fill_threads, speculate=speculate,
                      draft_model=draft_model, loop=loop)
        self.speculate = speculate  # rows that don't say take this (worker/speculate.py)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.streak_s = streak_s
        self.kv_budget = parse_bytes(kv_budget)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        # None until a submit finds one: an engine built where no loop runs (a plain
        # thread) serves on the loop of the code that first submits to it.
        self.loop = _aio.engine_loop(loop, required=False)
        self._t0 = time.perf_counter()
        self._pool = mlx_worker()
        prefix_bytes = parse_bytes(prefix_cache, "prefix_cache") or 0 if prefix_cache else 0
        self._prefix_cap = prefix_bytes
        self.model_name = model if isinstance(model, str) else getattr(
            model[0], "model_type", type(model[0]).__name__)
        with progress.loading(self.model_name):
            laps = Laps("load")
            if isinstance(model, (tuple, list)):
                m, tok = model
            else:
                m, tok = load_bounded(model, load_timeout)
            laps("model files")
            draft = draft_model
            if isinstance(draft, str) and not draft.strip().startswith("layers:"):
                progress.stage(f"loading draft {draft}")
                try:
                    draft = load_bounded(draft, load_timeout)
                except Exception as e:  # said of the draft, not of the model
                    raise ValueError(
                        f"could not load draft model {draft!r} ({type(e).__name__}: "
                        f"{one_line(e, 200)}); give an mlx-lm hub id, a local mlx-lm "
                        "directory, or layers:N") from None
            on_worker = self._on_worker
            # Validation and checks of finished texts run here; the worker compiles
            # matchers. (Constraints holds no MLX arrays and locks its own state.)
            self.constraints = Constraints(tok)
            self.constraints.warm()  # while the model sets up, not at the first submit
            self._exec = on_worker(BatchExecutor, m, tok, prefill_chunk, prefix_bytes,
                                   fuse, kv_bits, kv_group_size, fill_threads,
                                   self.constraints, draft,
                                   speculate is not None or draft is not None)
            try:  # a failure from here on lets go of the executor's model and caches
                if warmup:
                    progress.stage("warming up")
                laps("engine setup")
                self.warmup_s = warm_up(self._exec, run=on_worker) if warmup else 0.0
                self._report = on_worker(self._exec.report)
                facts = on_worker(self._exec.facts)
                if speculate == "draft" and "/draft " not in facts.speculation:
                    raise ValueError(f"speculate='draft' is not possible with this model: "
                                     f"speculation {facts.speculation}")
            except BaseException:
                ex, self._exec = self._exec, None
                on_worker(ex.close)
                raise
        self.model, self.tokenizer = m, tok
        self.cache_kinds: str = facts.cache_kinds
        self._paths = facts.paths
        self.layer_costs: List[tuple] = facts.layer_costs
        self.quantized_attention: bool = facts.quantized_attention
        self._prefix = facts.prefix_reuse
        self.speculation: str = facts.speculation  # 'lookup[/draft NAME]' or 'off: why'
        # the draft model's name (None: none), and its drafts verified / kept so far
        self.draft_model = (facts.speculation.split("/draft ", 1)[1]
                            if "/draft " in facts.speculation else None)
        self.draft_proposed = self.draft_accepted = 0
        self._adapters = {}  # name -> AdapterInfo (adapters.py)
        self.context_length = getattr(getattr(m, "args", None),
                                      "max_position_embeddings", None)
        # Prompts longer than this many characters cannot fit the context in any
        # tokenization, so they are refused before tokenizing (seconds for megabytes).
        longest = longest_token(tok)
        self.max_prompt_chars = (self.context_length * longest
                                 if self.context_length and longest else None)
        self.scheduler = Scheduler(max_batch, self.kv_budget, self.kv_bytes_for)
        self.steps: List[StepRecord] = []  # the latest reports._KEEP_STEPS steps
        self._nsteps = 0
        self._ids = itertools.count()
        self._hold_rows()  # rows, submitted, finished (protocol.HeldRows)
        self._held: Dict[int, Row] = {}  # rows waiting for their constraint's compile
        self._cancels: List[int] = []
        self._listeners: List[Callable] = []
        self._wake = asyncio.Event()
        self._interrupt = threading.Event()  # set on the loop: ends the worker's streak
        self._closed = False
        self.tracer = None  # see trace()
        self._task = None
        self._idle: Optional[asyncio.Future] = None
        self._closing: Optional[asyncio.Task] = None  # the one aclose that runs

    def _on_worker(self, fn, *args):
        """fn(*args) as one job on the shared MLX thread, between other engines' ticks."""
        return self._pool.submit(fn, *args).result()

    def kv_bytes_for(self, length: int, prefilling: bool = True) -> int:
        """Most KV bytes one row can hold at `length` tokens (what admission under
        kv_budget counts); `prefilling`: before its first token, when a sliding
        window also holds a prefill chunk. `cache_kinds` names the model's layer caches as batched,
        e.g. '24 recurrent-state + 8 attention layers, KV 4-bit'; `layer_costs` has
        each layer's (bytes per token, window or 0, fixed bytes), a draft model's
        layers after the model's (any row may hold draft KV)."""
        return row_kv_bytes(self.layer_costs, self.prefill_chunk, length, prefilling)

    def worker_state(self) -> Optional[WorkerState]:
        """What the MLX worker holds for this engine now (None once closed); waits
        for a tick in flight to end."""
        ex = self._exec
        return self._on_worker(ex.state) if ex is not None else None

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    # -- state -------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.scheduler.active)

    @property
    def queued(self) -> int:
        """Rows waiting: for room in the batch, or for their constraint's compile."""
        return len(self.scheduler.queue) + len(self._held)

    # -- cancelling ----------------------------------------------------------------
    def cancel(self, rows: Sequence[Row]) -> None:
        if self.loop is not None:  # else nothing was ever submitted
            _aio.call_soon(self.loop, self._cancel, list(rows))

    def cancel_all(self) -> None:
        self.cancel(list(self._live.values()))

    def _cancel(self, rows):
        for row in rows:
            if row.done or self._live.get(row.id) is not row:
                continue
            if row.id in self.scheduler.active:  # the worker holds it: its tick ends it
                self._cancels.append(row.id)
                self._stopping.add(row.id)
            else:  # queued, held for its constraint, or not yet enqueued (an interrupt
                # between submit's steps, a hop from another thread): nobody else will
                self._held.pop(row.id, None)
                self.scheduler.dequeue(row)
                self._end(row, Finish.CANCELLED)
        self._wake.set()
        self._interrupt.set()

    # -- the serving loop ----------------------------------------------------------
    def _ensure_task(self):
        if self._task is None or self._task.done():
            import contextvars

            # A fresh context: output from this long-lived task must not be tied to
            # the cell that happened to start it (ipykernel 7 sends a task's output
            # with the parent header of the cell that created it, even after it ends).
            serve = self._serve()
            try:
                self._task = self.loop.create_task(serve, context=contextvars.Context())
            except RuntimeError:  # the loop is closed: no task, so no coroutine left behind
                serve.close()
                raise

    async def _serve(self):
        try:
            await self._serve_rows()
        finally:  # a close waiting for the scheduler to go idle need wait no longer
            if self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    async def _serve_rows(self):
        while not self._closed:
            ex = self._exec
            if ex is None:  # closed from another thread
                break
            admits = self.scheduler.admit()
            cancels, self._cancels = self._cancels, []
            if not (admits or cancels or self._report.busy):
                self._wake.clear()
                if self._idle is not None and not self._idle.done():
                    self._idle.set_result(None)
                await self._wake.wait()
                continue
            # (in a function: a loop variable here would hold a row)
            _admitted(admits, self.clock(), self.scheduler.waited_for)
            t0 = time.perf_counter()
            # Let the worker run decode steps back to back. Rows queued for room need
            # no shorter streak: room comes from a row finishing, which ends it.
            self._interrupt.clear()
            try:
                report = await self.loop.run_in_executor(
                    self._pool, _failure_as_value, ex.tick,
                    [Admit(r.id, r.prompt_ids, r.params) for r in admits], cancels,
                    self.streak_s, self._interrupt)
            except Exception as e:  # the worker pool itself broke
                report = _Failed(e)
            if isinstance(report, _Failed):  # fail what the executor held
                e = report.error
                for rid in list(self.scheduler.active):
                    row = self._live.get(rid)
                    if row is not None:
                        self._end(row, Finish.ERROR,
                                  f"engine step failed: {type(e).__name__}: {e}".rstrip(": "))
                try:
                    await self.loop.run_in_executor(self._pool, ex.close)
                except Exception:  # the pool is gone (interpreter shutdown): here
                    ex.close()
                self._report = dataclasses.replace(self._report, busy=False)
                continue
            self._report = report
            self._apply(report, time.perf_counter() - t0)

    def trace(self, tracer) -> None:
        """Report each tick's parts, on the worker and here, to `tracer(name, seconds)`
        (core/_trace.py; `python -m bench decode --profile`); None turns it off."""
        self.tracer = tracer
        ex = self._exec
        if ex is not None:  # (a closed engine has no ticks to report)
            self._on_worker(ex.trace, tracer)

    def status(self) -> str:
        kv = self.steps[-1].kv_bytes if self.steps else 0
        budget = fmt_bytes(self.kv_budget) if self.kv_budget else "no limit"
        done = sum(self.finished.values())
        if self._exec is None:
            return f"model {self.model_name} (closed) | done {done}"
        chunk = self._report.prefill_chunk  # as the latest tick left it
        mode = "auto" if self.prefill_chunk is None else "fixed"
        adapters = self.adapter_status()
        kinds = self.cache_kinds + (" (as loaded: a later Engine load on this model "
                                    "object has set its layers up again since)"
                                    if self._paths.superseded else "")
        return (f"model {self.model_name} | running {self.running}, queued {self.queued}, "
                f"done {done} | KV {fmt_bytes(kv)} / {budget} | prefill {chunk} "
                f"tokens/step ({mode}) | {kinds} | prefix reuse "
                f"{self._prefix}{self._prefix_held()} | {self._speculation_status()}"
                + (f" | {adapters}" if adapters else ""))

    def _speculation_status(self) -> str:
        """What rows get by default, and what they may ask for ('lookup[/draft NAME]')
        or why none can."""
        if self.speculation.startswith("off"):
            return f"speculation {self.speculation}"
        default = "off" if self.speculate is None else self.speculate
        return (f"speculation {default} by default, rows may ask {self.speculation}"
                f"{self._draft_status()}")

    def _prefix_held(self) -> str:
        held = self._report.prefix_bytes
        return f" (holding {fmt_bytes(held)} of {fmt_bytes(self._prefix_cap)})" if held else ""

    def _draft_status(self) -> str:
        if self.draft_model is None:
            return ""
        n, a = self.draft_proposed, self.draft_accepted
        return (f" (draft acceptance {100 * a / n:.0f}% of {n} drafts)" if n
                else " (no drafts verified yet)")

    def __repr__(self):
        return f"<mlxnb.Engine {self.status()}>"
