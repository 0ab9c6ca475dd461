"""Progress for a model's first load: converting the bundled GGUF, reading weights,
warming up. Each can take tens of seconds on a cold machine; without feedback a
notebook cell or `python -m mlxnb demo` just sat there.

One tqdm line per load, shown only when the load takes longer than `DELAY_S`, so
quick loads print nothing. In a terminal it is tqdm's own line on stderr. In a
notebook the same line is one text output updated in place by display id, ending as
"loaded ... in N s": tqdm's notebook bar is a widget, and a saved notebook would show
"Error displaying widget: model not found" where it was. The stages run on the
engine's MLX worker thread while the caller waits, so the bar is module state, and a
small thread (in the caller's context, so its output lands in the caller's cell)
redraws it twice a second, which also keeps the clock moving through one long stage.
``MLXNB_PROGRESS=0`` turns it off; output to a file or pipe gets none. Hub downloads
show huggingface_hub's own bars.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
import uuid

DELAY_S = 1.0
TICK_S = 0.5
_bar = None  # the load in progress, if any
_lock = threading.Lock()


class _CellLine:
    """A file for tqdm that shows its latest line as one notebook output."""

    def __init__(self):
        self.display_id = f"mlxnb-load-{uuid.uuid4().hex}"
        self.shown = False

    def write(self, s: str) -> None:
        line = s.replace("\r", "").strip()
        if line:  # tqdm clears its line with blanks when it closes: keep the last one
            self.show(line)

    def flush(self) -> None:
        pass

    def show(self, line: str) -> None:
        from IPython.display import display, update_display

        try:
            if self.shown:
                update_display({"text/plain": line}, raw=True, display_id=self.display_id)
            else:
                display({"text/plain": line}, raw=True, display_id=self.display_id)
                self.shown = True
        except Exception:  # the kernel is going away: progress is not worth an error
            pass


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def _tty() -> bool:
    import sys

    try:
        return sys.stderr.isatty()
    except Exception:
        return False


def stage(name: str) -> None:
    """Say which stage the current load is in (no-op outside `loading`); the ticker
    shows it at its next redraw."""
    with _lock:
        if _bar is not None:
            _bar.n = min(_bar.total, _bar.n + 1)
            _bar.set_postfix_str(name, refresh=False)


@contextlib.contextmanager
def loading(what: str, stages: int = 3):
    """A progress line for one model load: `with loading(name): ...`."""
    global _bar
    if os.environ.get("MLXNB_PROGRESS", "1") == "0" or _bar is not None:
        yield
        return
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with huggingface_hub; without it, no line
        yield
        return
    cell = _CellLine() if _in_kernel() else None
    if cell is None and not _tty():  # a log file or pipe: redraws would pile up in it
        yield
        return
    bar = tqdm(total=stages, desc=f"mlxnb: loading {what}", unit="stage", delay=DELAY_S,
               leave=False, bar_format="{desc} [{elapsed}]{postfix}", file=cell)
    bar.set_postfix_str("reading weights", refresh=False)
    seen = ["reading weights"]
    done = threading.Event()

    def tick():
        while not done.wait(TICK_S):
            with _lock:
                if bar.postfix and bar.postfix != seen[-1]:
                    seen.append(bar.postfix)
                # tqdm's own `delay` holds back update(), not refresh(): honour it here
                if time.time() - bar.start_t >= DELAY_S:
                    bar.refresh()

    ticker = threading.Thread(target=contextvars.copy_context().run, args=(tick,),
                              name="mlxnb-progress", daemon=True)
    with _lock:
        _bar = bar
    ticker.start()
    t0 = time.perf_counter()
    loaded = False
    try:
        yield
        loaded = True
    finally:
        done.set()
        ticker.join(timeout=2)
        with _lock:
            _bar = None
            bar.close()
        if cell is not None and cell.shown:  # (a failed load's error follows this line)
            cell.show(f"mlxnb: {'loaded' if loaded else 'stopped loading'} {what} in "
                      f"{time.perf_counter() - t0:.1f} s ({', '.join(seen)})")
