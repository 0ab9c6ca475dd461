"""Timing hooks for profilers (`python -m bench decode --profile`): a tracer is a callable
`(name, value)` that the engine calls with the seconds each part of a tick took, and
a few counts ("n.*"). Unset (None), a hook costs one attribute check."""

from __future__ import annotations

import functools
import time

pc = time.perf_counter


def timed(name: str):
    """Report a method's duration to `self.tracer` as `name`."""
    def deco(fn):
        @functools.wraps(fn)
        def traced(self, *a, **k):
            tr = self.tracer
            if tr is None:
                return fn(self, *a, **k)
            t = pc()
            try:
                return fn(self, *a, **k)
            finally:
                tr(name, pc() - t)
        return traced
    return deco


def lap(tr, name: str, since: float) -> float:
    """Report the time since `since` as `name`; returns now (the next lap's start)."""
    now = pc()
    tr(name, now - since)
    return now
