"""Progress for a model's first load: converting the bundled GGUF, reading weights,
warming up. Each can take tens of seconds on a cold machine; without feedback a
notebook cell or `python -m mlxnb demo` just sat there.

One tqdm bar per load (`tqdm.auto`: a bar widget in a notebook, a text line in a
terminal), shown only when the load takes longer than `DELAY_S`, so quick loads print
nothing. The stages run on the engine's MLX worker thread while the caller waits, so
the bar is module state rather than something passed down, and a small thread keeps
its clock moving while one long call (a conversion, a compile) runs.
``MLXNB_PROGRESS=0`` turns it off. Hub downloads show huggingface_hub's own bars.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

DELAY_S = 1.0
_bar = None  # the load in progress, if any
_lock = threading.Lock()


def _show(bar) -> None:
    # tqdm's own `delay` holds back update(), not refresh(): honour it here too
    if time.time() - bar.start_t >= DELAY_S:
        bar.refresh()


def stage(name: str) -> None:
    """Say which stage the current load is in (no-op outside `loading`)."""
    with _lock:
        if _bar is not None:
            _bar.n = min(_bar.total, _bar.n + 1)
            _bar.set_postfix_str(name, refresh=False)
            _show(_bar)


@contextlib.contextmanager
def loading(what: str, stages: int = 3):
    """A bar for one model load of at most `stages` stages: `with loading(name): ...`."""
    global _bar
    if os.environ.get("MLXNB_PROGRESS", "1") == "0" or _bar is not None:
        yield
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with huggingface_hub; without it, no bar
        yield
        return
    bar = tqdm(total=stages, desc=f"mlxnb: loading {what}", unit="stage", delay=DELAY_S,
               leave=False, bar_format="{desc} [{elapsed}]{postfix}")
    bar.set_postfix_str("reading weights", refresh=False)
    done = threading.Event()

    def tick():  # the elapsed time moves even while one stage takes long
        while not done.wait(0.5):
            with _lock:
                _show(bar)

    ticker = threading.Thread(target=tick, name="mlxnb-progress", daemon=True)
    with _lock:
        _bar = bar
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join(timeout=2)
        with _lock:
            _bar = None
            bar.close()
