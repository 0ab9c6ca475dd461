"""`EngineLike`: what the notebook surface (magics, `Run`, the widget) uses of an engine.

Two engines satisfy it: `mlxnb.Engine` (a model in this process) and
`mlxnb.remote.RemoteEngine` (an OpenAI-compatible server). Code that takes an engine
types it as `EngineLike` and never asks which one it holds.

Optional attributes for the charts (absent means the local engine's meaning):
`kv_unit` -- "bytes" (StepRecord.kv_bytes are bytes), "fraction" (0..1 of the server's
KV cache) or None (not reported); `batch_reported` -- False when StepRecord.batch_size
is not known.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from typing import (Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from .._log import swallowed
from .rows import Row, SamplingParams, StepRecord
from .run import Run


class Listeners:
    """An engine's listeners: fn(kind, obj) on its loop, for ('submit', Row),
    ('step', StepRecord) and ('finish', Row). A failing listener is logged and the
    engine goes on (the host class sets `self._listeners = []`)."""

    _listeners: List[Callable]

    def add_listener(self, fn: Callable) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _notify(self, kind, obj):
        for fn in list(self._listeners):
            try:
                fn(kind, obj)
            except (Exception, asyncio.CancelledError, SystemExit, GeneratorExit):
                # a listener's bug must not stop generation (an interrupt still does)
                swallowed("engine listener", fn)


class HeldRows:
    """The rows an engine lists. It keeps unfinished rows only: a finished one stays
    listed while something else (a Run, a widget, a variable) holds it, so a kernel
    that runs for days stays flat. The host class calls `_hold_rows()` in its
    __init__, counts a submit in `_nsubmitted` and a finish in `finished`."""

    def _hold_rows(self) -> None:
        self._live: Dict[int, Row] = {}  # unfinished rows, by id
        self._finished = weakref.WeakValueDictionary()  # finished rows someone holds
        self.finished = Counter()  # finish reason -> rows ended with it
        self._nsubmitted = 0
        self._stopping: set = set()  # ids of live rows asked to stop, not yet ended

    @property
    def rows(self) -> List[Row]:
        """Rows in submission order: every unfinished one, and finished ones while
        something else still holds them."""
        rows = list(self._live.values())
        rows += [r for r in (ref() for ref in self._finished.valuerefs()) if r is not None]
        rows.sort(key=lambda r: r.id)
        return rows

    @property
    def submitted(self) -> int:
        """Rows submitted so far, finished ones included (`finished` counts those by
        finish reason)."""
        return self._nsubmitted

    @property
    def stopping(self) -> int:
        """Rows asked to stop that have not ended yet (a running row ends at its next
        step boundary)."""
        return len(self._stopping)


@runtime_checkable
class EngineLike(Protocol):
    model_name: str
    loop: asyncio.AbstractEventLoop
    rows: List[Row]  # rows still held (unfinished, or kept by a caller), in order
    submitted: int  # rows submitted so far
    finished: Any  # Counter: finish reason -> rows ended with it
    steps: List[StepRecord]  # chart samples, oldest first
    max_batch: int
    kv_budget: Optional[int]

    @property
    def running(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def stopping(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def clock(self) -> float: ...

    def prepare(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
                **params) -> Tuple[Any, SamplingParams]:
        """Validate without submitting; raises ValueError (one line)."""

    def submit(self, prompt: str, *, chat: bool = True, system: Optional[str] = None,
               tag=None, **params) -> Row: ...

    def submit_prepared(self, prompt: str, prepared: Any, sp: SamplingParams, tag=None,
                        err: Optional[str] = None) -> Row: ...

    def generate(self, prompts: Iterable[str], *, chat: bool = True,
                 system: Optional[str] = None, **params) -> Run: ...

    def cancel(self, rows: Sequence[Row]) -> None: ...

    def cancel_all(self) -> None: ...

    def add_listener(self, fn: Callable) -> None:
        """fn(kind, obj) on the loop: ('submit', Row), ('step', StepRecord), ('finish', Row)."""

    def remove_listener(self, fn: Callable) -> None: ...

    async def wait(self) -> None: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...

    def status(self) -> str: ...
