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

import os
import threading
import time
from concurrent.futures import Future, TimeoutError as _Timeout
from typing import Callable, Optional

from IPython.core.error import UsageError

from .. import _aio
from .._text import one_line
from . import cellparse as cp
from .magicargs import _CONNECT, _parse
from .session import _S, _close, get_engine, refuse_if_busy

__all__ = ["CONNECT_WAIT_S", "Connecting", "command", "start", "settle", "install",
           "abandon", "pending"]

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
    _S.engine, _S.model_spec, _S.settings = new, new.model_name, None
    if old is not None and old is not new:
        _close(old)
    charts = (f"{new.metrics_source} /metrics" if new.load.reported
              else "server load not reported by this server")
    print(f"mlxnb: connected to {new.url}, model {new.model_name!r} ({charts}); "
          "`%mlxnb load` switches back to a local model")


def command(rest: str) -> None:
    """`%mlxnb connect URL [--model NAME] [--api-key-env VAR] [--max-concurrency N]
    [--timeout S]`: check the options, then `start` the connection."""
    usage = ("write %mlxnb connect URL [--model NAME] [--api-key-env VAR] "
             "[--max-concurrency N] [--timeout S]")
    a = _parse(_CONNECT, rest, "%mlxnb connect", usage)
    mc = cp.parse_values("max_concurrency", a.max_concurrency, int, sweep=False)[0]
    if mc is not None and mc < 1:
        raise UsageError(f"%mlxnb connect: --max-concurrency must be a positive "
                         f"integer; got {mc}")
    try:
        timeout = cp.parse_values("timeout", a.timeout, float, sweep=False)[0]
    except UsageError as e:
        raise UsageError(f"%mlxnb connect: {e}") from None
    if timeout is not None and timeout <= 0:
        raise UsageError(f"%mlxnb connect: --timeout must be a positive number of "
                         f"seconds (e.g. --timeout 60); got {a.timeout}")
    key = None
    if a.api_key_env is not None:  # the key itself never appears in a cell
        try:
            key = os.environ.get(a.api_key_env)
        except (UnicodeEncodeError, ValueError):  # (a NUL, a lone surrogate)
            raise UsageError(f"%mlxnb connect: --api-key-env {a.api_key_env!r} is not a "
                             "valid environment variable name; give the name of the "
                             "variable holding the key") from None
        if not key:
            raise UsageError(f"%mlxnb connect: the environment variable {a.api_key_env!r} "
                             "is not set or empty; set it to the API key before starting "
                             "Jupyter (or with os.environ in a cell not saved)")
    eng = get_engine()
    refuse_if_busy(eng, "connecting")
    from ..remote import connect
    from ..remote.client import PROBE_S

    abandon()  # a newer connect replaces one still under way
    more = {} if timeout is None else {"timeout": timeout}
    loop = _aio.shell_loop()
    try:
        new, c = start(
            lambda: connect(a.url, model=a.model, api_key=key,
                            max_concurrency=mc or 64, loop=loop, **more),
            shown(a.url), min(PROBE_S, timeout or PROBE_S))
    except ValueError as e:
        raise UsageError(f"%mlxnb connect: {one_line(e, 300)}") from None
    if c is not None:  # the server has not answered yet: the kernel goes on
        _S.connecting = c
        print(f"mlxnb: connecting to {c.url}: no answer yet (it has up to "
              f"{c.bound:g} s); the next %%generate or `%mlxnb status` says how it went")
        return None
    install(new, eng)
    return None
