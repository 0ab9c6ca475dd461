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
from typing import Any, Callable, Iterable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

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
            except Exception:  # a listener's bug must not stop generation
                swallowed("engine listener", fn)


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
