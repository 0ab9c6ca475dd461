"""What a widget reads of an engine that no longer exists.

A widget holds its engine weakly (it shows rows; it must not keep a closed engine's
model alive), so once the engine is collected it reads this stand-in instead.
"""

from __future__ import annotations

import time


class GoneEngine:
    """An engine's fixed figures, no rows running, nothing to listen to or cancel."""

    running = queued = 0
    steps = rows = ()

    def __init__(self, engine):
        self.model_name = getattr(engine, "model_name", "")
        self.kv_budget = getattr(engine, "kv_budget", None)
        self.max_batch = getattr(engine, "max_batch", None)
        self.kv_unit = getattr(engine, "kv_unit", "bytes")
        self.batch_reported = getattr(engine, "batch_reported", True)
        self.cache_kinds = getattr(engine, "cache_kinds", None)
        self.loop = engine.loop
        # its clock runs on from the engine's, so times stay on the rows' scale
        self._t0 = time.perf_counter() - engine.clock()

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def add_listener(self, fn):
        pass

    def remove_listener(self, fn):
        pass

    def cancel(self, rows):
        pass
