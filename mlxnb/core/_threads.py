"""The threads an Engine runs on, beside the event loop: the process's one MLX
worker, a time-bounded call (chat templates), and model loading on a thread of its
own. The worker's state (the pool, its OS thread ids) lives here alone, with what
keeps it sound across fork and interpreter exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

LOAD_TIMEOUT_S = 900.0  # default bound on reading a model (a download included)


class TemplateTimeout(Exception):
    """Raised inside a chat-template render that ran past its time bound."""


_WORKER_TIDS: set = set()
_WORKER: Optional[ThreadPoolExecutor] = None
_WORKER_LOCK = threading.Lock()


def mlx_worker() -> ThreadPoolExecutor:
    """The process's one MLX thread, shared by every Engine.

    MLX keeps streams and, on CUDA, its per-shape kernel state (cuDNN attention
    graphs, CUDA graphs, library handles) in thread-locals (`thread_local` across
    mlx/backend/cuda). With a thread per Engine every new Engine -- a re-run cell,
    `%mlxnb load` -- started cold: each prefill shape paid its 50-300 ms setup again."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxnb-mlx")
            _WORKER_TIDS.add(_WORKER.submit(threading.get_native_id).result())
        return _WORKER


def _forget_worker():
    # A forked child inherits _WORKER but not its thread: without this, Engine()
    # there would hang on the first submit.
    global _WORKER
    _WORKER = None
    _WORKER_TIDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


@atexit.register
def _await_worker_exit():
    # MLX's thread-local destructors take the GIL as a thread exits; a worker still
    # exiting while the interpreter finalizes aborts the process ("terminate called
    # without an active exception", rc 134, ~10% of script runs). atexit runs after
    # the pool threads are joined, so wait (bounded) until their OS threads are gone.
    deadline = time.monotonic() + 2.0
    for tid in list(_WORKER_TIDS):
        while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.001)


def bounded(fn, timeout: float):
    """fn() on a helper thread, waited for at most `timeout` s; past that the thread is
    stopped with an exception raised inside it (it runs Python code: a template render)
    and TemplateTimeout raised here."""
    box = {}

    def work():
        try:
            box["ok"] = fn()
        except BaseException as e:
            box["err"] = e

    t = threading.Thread(target=work, daemon=True, name="mlxnb-template")
    t.start()
    try:
        t.join(timeout)
    finally:
        if t.is_alive():  # timed out or interrupted: do not leave it spinning
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                       ctypes.py_object(TemplateTimeout))
    if t.is_alive():
        raise TemplateTimeout()
    if "err" in box:
        raise box["err"]
    return box["ok"]


def load_bounded(name, timeout: Optional[float]):
    """`models.load_model(name)` on a thread of its own, waited for at most `timeout`
    seconds (None: no limit); an interrupt (KeyboardInterrupt) ends the wait at once.

    Reading weights, a download or a hung file system may block for good; off the
    caller's thread and off the MLX worker that steps running batches, the cost is one
    abandoned thread, whose result is dropped if it ever comes. mlx-lm evaluates the
    weights it loads, so the worker uses them as plain buffers."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        _WORKER_TIDS.add(threading.get_native_id())  # it runs MLX: see _await_worker_exit
        try:
            from ..models.loading import load_model

            fut.set_result(load_model(name))
        except BaseException as e:  # handed to the waiting thread
            fut.set_exception(e)

    threading.Thread(target=work, daemon=True, name="mlxnb-load").start()
    deadline = None if timeout is None else time.monotonic() + timeout
    # Short waits: a pending interrupt is raised between them (one untimed wait sleeps
    # through an interrupt that arrives as a flag, not as a signal to this thread).
    while True:
        left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
        try:
            return fut.result(max(left, 0.0))
        except concurrent.futures.TimeoutError:
            if deadline is None or time.monotonic() < deadline:
                continue
        from ..models.loading import ModelLoadError

        raise ModelLoadError(
            f"loading {str(name)!r} took longer than {timeout:g} s (a stalled download or "
            "file system?); check the network or the path, or pass load_timeout=None "
            "(%config MLXNB.load_timeout = None) to wait without a limit") from None


def release_heap() -> None:
    """Hand freed heap memory back to the system. glibc keeps what a thread freed in
    that thread's arena; weights read on a loader thread and freed at close left
    ~500 MB of RSS per kernel behind (`python -m bench reliability cycles`) until trimmed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
