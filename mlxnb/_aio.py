"""Which event loop, which thread: the one place mlxnb answers these questions.

An Engine serves its rows on one asyncio loop (the kernel's, in a notebook) and
creates their futures there. Code may reach it from elsewhere: ipykernel 7 subshells
run cells on another thread with a loop of their own, and an Engine may be built or
fed from a plain thread. Everything that crosses over goes through these helpers, so
a loop that can never run is refused with a message instead of a silent hang.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Callable, Optional


class NoLoopError(RuntimeError):
    """No running event loop can be reached for an Engine; the message says what to do."""


_HOW = ("build the engine inside async code (asyncio.run(main())), in a notebook cell, "
        "or pass loop= an event loop that runs")


def running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def kernel_loop() -> Optional[asyncio.AbstractEventLoop]:
    """The IPython kernel's loop, from any thread and also before it runs (an extension
    loaded at kernel start); None outside a kernel."""
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    ip = ipython.get_ipython() if ipython is not None else None
    io_loop = getattr(getattr(ip, "kernel", None), "io_loop", None)
    return getattr(io_loop, "asyncio_loop", None)


def shell_loop() -> asyncio.AbstractEventLoop:
    """The loop the magics bind: the kernel's (also from a subshell thread), else the
    running one, else IPython's autoawait loop (terminal IPython runs it per cell)."""
    loop = kernel_loop() or running_loop()
    if loop is None:
        from IPython.core.async_helpers import get_asyncio_loop

        loop = get_asyncio_loop()
    return loop


def engine_loop(loop=None, required: bool = True) -> Optional[asyncio.AbstractEventLoop]:
    """The loop an engine binds: `loop` if given, else the caller's running loop, else
    the kernel's. A plain thread outside a kernel has none (asyncio would hand it a
    fresh loop that nothing ever runs): None, or with `required` a refusal."""
    if loop is None:
        loop = running_loop() or kernel_loop()
        if loop is None:
            if not required:
                return None
            raise NoLoopError(f"an mlxnb engine needs a running asyncio event loop to serve "
                              f"rows on and this thread has none; {_HOW}")
    if loop.is_closed():
        raise NoLoopError(f"the event loop given to the engine is closed; {_HOW}")
    return loop


def on_thread(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller may touch objects bound to `loop` directly: it runs on the
    loop's thread (or the loop runs nowhere yet)."""
    here = running_loop()
    if here is not None:
        return here is loop
    # BaseEventLoop records its thread while run_forever runs
    return getattr(loop, "_thread_id", None) in (None, threading.get_ident())


def _check_reachable(loop) -> None:
    if loop.is_closed():
        raise NoLoopError("this Engine's event loop is closed; create a new Engine")
    if not loop.is_running():
        raise NoLoopError("this Engine's event loop is not running, so nothing would "
                          f"ever happen; {_HOW}")


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """fn(*args) on `loop`'s thread: at once when the caller is there, else queued
    (asyncio objects are not thread-safe)."""
    if on_thread(loop):
        fn(*args)
        return
    _check_reachable(loop)
    loop.call_soon_threadsafe(fn, *args)


def call_soon_or_here(loop: Optional[asyncio.AbstractEventLoop], fn: Callable) -> bool:
    """fn() on `loop`'s thread (as call_soon), or here at once where no loop can run
    it (none bound, closed, not running): a close must end its rows either way.
    True when it went to the loop."""
    try:
        if loop is None:
            raise NoLoopError()
        call_soon(loop, fn)
        return True
    except NoLoopError:
        fn()
        return False


def awaitable_on(loop: asyncio.AbstractEventLoop, make_awaitable: Callable):
    """An awaitable for `make_awaitable()` run on `loop`, awaitable from whatever loop
    is running (a subshell's loop hops over to `loop`)."""
    here = running_loop()
    if here is None or here is loop:
        return make_awaitable()
    _check_reachable(loop)

    async def hop():
        return await make_awaitable()

    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(hop(), loop))
