"""The package's logger, `logging.getLogger("mlxnb")`.

Some failures must not stop generation: a listener's or a row callback's bug, a
warm-up path the model cannot run (real rows then fail with a message of their own),
a widget that cannot sync. They are logged here instead of raised: a warning with the
traceback the first time each kind and function fails, debug after that (a listener
runs every step; a broken one must not flood the notebook).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("mlxnb")
_warned: set = set()


def swallowed(what: str, fn=None) -> None:
    """Log the exception being handled: `what` failed (in `fn`, if given)."""
    name = getattr(fn, "__qualname__", None) or (type(fn).__name__ if fn is not None else "")
    key = (what, name)
    level = logging.DEBUG if key in _warned else logging.WARNING
    _warned.add(key)
    log.log(level, "%s failed%s (ignored; generation goes on)", what,
            f" in {name}" if name else "", exc_info=True)


class Laps:
    """Debug-logs how long each part of a job of several parts took ("load: padding
    check 1.2 s"): call it with a part's name as that part ends. On a fresh machine
    an engine's start is mostly first-use kernel compiles, and this says where."""

    def __init__(self, job: str):
        self.job, self.t = job, time.perf_counter()

    def __call__(self, part: str) -> None:
        t = time.perf_counter()
        log.debug("%s: %s %.1f s", self.job, part, t - self.t)
        self.t = t
