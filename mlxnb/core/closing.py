"""How an Engine waits for its rows and closes: every row ends with a finish reason,
and the model, its caches and the tokenizer are let go on the worker that owns them."""

from __future__ import annotations

import asyncio
import gc

from .. import _aio
from .._log import log
from ._threads import release_heap
from .states import Finish


class Closing:
    """Engine's waiting and closing (a mixin: it reads the Engine's rows, loop,
    serving task and executor)."""

    async def wait(self) -> None:
        """Wait until every submitted row has finished."""
        async def on_loop():
            while self._live:
                await asyncio.shield(asyncio.gather(
                    *[r._future for r in list(self._live.values())]))

        if self.loop is not None:
            await _aio.awaitable_on(self.loop, on_loop)

    async def aclose(self) -> None:
        """Cancel what is running, stop the scheduler and release the model, its caches
        and the tokenizer (rows keep their results)."""
        if self.loop is None:  # nothing was submitted: close on the caller's loop
            self.loop = asyncio.get_running_loop()
        await _aio.awaitable_on(self.loop, self._aclose)

    async def _aclose(self):
        # One close runs; overlapping callers wait for it (a second one would replace
        # the first's wait for the scheduler going idle, leaving it to time out).
        if self._closing is None:
            self._closing = self.loop.create_task(self._close_once())
        await asyncio.shield(self._closing)

    async def _close_once(self):
        if self._closed:
            return
        self.cancel_all()
        if self._task is not None and not self._task.done():
            self._idle = self.loop.create_future()
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), timeout=10)
            except asyncio.TimeoutError:
                log.warning("aclose: the scheduler did not go idle within 10 s; closing anyway")
        ex = self._shut()
        if ex is not None:
            try:
                await self.loop.run_in_executor(self._pool, ex.shut)
                # The worker drops its reference to a finished job only after its
                # result is delivered: one more job makes sure that it has, so the
                # model is free when this returns (fused layers hold reference
                # cycles: collect them now, not at some later allocation).
                del ex
                await self.loop.run_in_executor(self._pool, int)
                gc.collect()
                release_heap()
            except RuntimeError:  # interpreter shutdown already stopped the worker
                pass

    def close(self) -> None:
        """Synchronous close for scripts/atexit: cancel everything, release the model,
        its caches and the tokenizer."""
        if self._closed:
            return
        ex = self._shut()
        if ex is not None:
            try:  # after any tick in flight: the worker runs one thing at a time
                self._pool.submit(ex.shut)
                self._pool.submit(release_heap)
            except RuntimeError:  # interpreter shutdown already stopped the worker
                pass

    def _shut(self):
        """Mark closed, end every row, let go of everything that holds device memory;
        returns the executor for the caller to close on the worker."""
        self._closed = True
        self._interrupt.set()
        _aio.call_soon_or_here(self.loop, self._end_all)  # (asyncio objects: the loop's)
        ex, self._exec = self._exec, None
        self.model = self.tokenizer = None
        return ex

    def _end_all(self):
        try:
            self._wake.set()
        except RuntimeError:  # the loop is closed: no serving task to wake
            pass
        for row in list(self._live.values()):  # nothing is left without a finish reason
            self._end(row, Finish.CANCELLED)
        self._cancels.clear()
        self.scheduler.clear()
        self._notify("close", self)
        self._listeners.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _shutting(self) -> bool:
        """Closed, or an aclose() has begun: rows submitted now would only hold it up."""
        return self._closed or self._closing is not None

    def _check_open(self):
        if self._shutting:
            raise RuntimeError(f"this Engine is {'closed' if self._closed else 'closing'}; "
                               "create a new one")
