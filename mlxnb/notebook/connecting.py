"""`%mlxnb connect` without holding the kernel.

Connecting probes the server (remote/client.py: up to 5 s, or --timeout when
shorter). A cell magic runs on the kernel's loop, so waiting there would freeze
every widget and stream for that long. The probe runs on a thread of its own; the
magic waits for it at most CONNECT_WAIT_S (a server that answers, answers well
within it) and otherwise returns, saying the connection is under way. Once the server
answers, the next magic installs the engine; a failure is reported by the next magic
(one line, once). Until then `%%generate` says in one line that it is still connecting.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as _Timeout
from typing import Callable, Optional

from IPython.core.error import UsageError

from .._text import one_line
from .session import _S, _close, get_engine

__all__ = ["CONNECT_WAIT_S", "Connecting", "start", "settle", "install", "abandon",
           "pending"]

CONNECT_WAIT_S = 0.5


class Connecting:
    """A connection under way: its URL (no credentials), its probe's bound, and the
    future engine."""

    def __init__(self, url: str, bound: float, fut: Future):
        self.url, self.bound, self.fut = url, bound, fut
        self.t0 = time.monotonic()

    def describe(self) -> str:
        return (f"still connecting to {self.url} ({time.monotonic() - self.t0:.0f} s so "
                f"far; it has up to {self.bound:g} s to answer)")

    def abandon(self) -> None:
        """Give up on it: an engine it still makes is closed at once."""
        def close(f):
            if f.exception() is None:
                f.result().close()

        self.fut.add_done_callback(close)

    def settle(self, install: Callable) -> None:
        """(The next magic.) `install(engine)` once connected; UsageError while still
        connecting, or (once) with why it failed."""
        if not self.fut.done():
            raise UsageError(f"mlxnb: {self.describe()}; run this again in a moment "
                             "(`%mlxnb load` switches to a local model instead)")
        err = self.fut.exception()
        if err is not None:
            raise UsageError(f"%mlxnb connect: {one_line(err, 300)}") from None
        install(self.fut.result())


def start(make: Callable, url: str, bound: float) -> tuple:
    """Run `make()` (it connects) on a thread of its own and wait for it at most
    CONNECT_WAIT_S: (engine, None) when it is done, (None, Connecting) when it goes
    on. Its ValueError (one line) is raised here when it came within the wait."""
    fut: Future = Future()

    def work():
        try:
            fut.set_result(make())
        except BaseException as e:  # handed to whoever settles it
            fut.set_exception(e)

    threading.Thread(target=work, daemon=True, name="mlxnb-connect").start()
    end = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:  # short waits: an interrupt is raised between them
            return fut.result(max(0.0, min(0.1, end - time.monotonic()))), None
        except _Timeout:
            if time.monotonic() >= end:
                return None, Connecting(url, bound, fut)


def shown(url: str) -> str:
    """`url` without user:password@ (what the messages may show)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(url)
        return urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, "", ""))
    except ValueError:
        return "the server"


def pending() -> Optional[Connecting]:
    return getattr(_S, "connecting", None)


def abandon() -> None:
    c = pending()
    if c is not None:
        c.abandon()
        _S.connecting = None


def settle() -> None:
    """(Each magic that needs the engine.) A connection under way: its engine
    installed once connected; UsageError while it is not (or, once, why it failed)."""
    c = pending()
    if c is None:
        return
    try:
        c.settle(lambda new: install(new, get_engine()))
    except UsageError:
        if c.fut.done():  # reported once
            _S.connecting = None
        raise
    _S.connecting = None


def install(new, old) -> None:
    """Make the connected engine the kernel's (closing `old`) and say so."""
    _S.engine, _S.model_spec = new, new.model_name
    if old is not None and old is not new:
        _close(old)
    charts = (f"{new.metrics_source} /metrics" if new.load.reported
              else "server load not reported by this server")
    print(f"mlxnb: connected to {new.url}, model {new.model_name!r} ({charts}); "
          "`%mlxnb load` switches back to a local model")
