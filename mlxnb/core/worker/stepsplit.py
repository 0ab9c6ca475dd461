"""Where each step's time went, measured on every step (the step inspector shows it).

The worker's timing hooks (`_trace.py`) call a tracer with each part's seconds; a
`StepSplit` is the tracer the executor always holds. It sums the parts of the step in
progress into three buckets and hands everything on to a profiler's tracer when one
is set (`Engine.trace`), so profiling sees what it saw before. The step's remaining
time is the worker's own bookkeeping (joining rows, reading tokens back, stop
checks, KV accounting); the engine adds the loop's share. A hook costs two clock
reads and a call: a few microseconds per step.
"""

from __future__ import annotations

from typing import Callable, Optional

# hook name -> bucket
BUCKETS = {
    "launch.fwd_build": "build", "prefill.fwd_build": "build", "launch.sample": "build",
    "launch.async_eval": "launch",
    "read.wait": "device", "prefill.eval": "device",
}
PARTS = ("build", "launch", "device")  # then "worker" (the rest of the step)


class StepSplit:
    """A tracer: `split(name, seconds)`; `take(step_seconds)` -> the step's split."""

    def __init__(self):
        self.user: Optional[Callable] = None  # a profiler's tracer (Engine.trace)
        self._acc = dict.fromkeys(PARTS, 0.0)

    def __call__(self, name: str, value: float) -> None:
        b = BUCKETS.get(name)
        if b is not None:
            self._acc[b] += value
        if self.user is not None:
            self.user(name, value)

    def take(self, seconds: float) -> tuple:
        """(build, launch, device, worker) seconds of the step just ended; resets."""
        acc = self._acc
        parts = tuple(acc[p] for p in PARTS)
        self._acc = dict.fromkeys(PARTS, 0.0)
        return parts + (max(0.0, seconds - sum(parts)),)
