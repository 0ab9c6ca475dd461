"""Rows are freed once the user drops them: after many `%%generate` cells whose runs,
results and `Out` history are dropped, no row of theirs is alive and memory stays
flat. (ipywidgets keeps every open widget for good, so what a widget holds after its
rows finish is what a long session keeps.)"""

import asyncio
import gc
import tracemalloc
import weakref

import pytest
from IPython.core.interactiveshell import InteractiveShell

from mlxnb import Engine
from mlxnb.notebook import magics

ROWS_PER_CELL = 20


async def cells(ip, n: int) -> None:
    """n cells of ROWS_PER_CELL rows each, as a user runs them (`-o run`, its widget,
    the result awaited), then what the user held dropped. (IPython's own output
    history, `Out` and `_`, holds a cell's value until `%reset out`; that is not
    mlxnb's to free, so the magic is called directly here.)"""
    prompts = "\n".join(f"p{i}" for i in range(ROWS_PER_CELL))
    for _ in range(n):
        ip.run_cell_magic("generate", "--max-tokens 3 -o run", prompts)
        ip.user_ns["r"] = await ip.user_ns["run"]
    del ip.user_ns["run"], ip.user_ns["r"]
    await asyncio.sleep(0.3)  # the widgets' last flush
    gc.collect()


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    magics.load_ipython_extension(ip)
    yield ip
    magics.unload_ipython_extension(ip)


def test_dropped_rows_are_freed_and_memory_stays_flat(tiny, arun, shell):
    async def main():
        eng = magics.use(Engine(tiny, loop=asyncio.get_running_loop(), kv_budget=None,
                                warmup=False), name="tiny")
        refs = []
        eng.add_listener(lambda kind, obj: refs.append(weakref.ref(obj))
                         if kind == "submit" else None)
        try:
            await cells(shell, 5)  # warm: first-use caches, classes, the compiled steps
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            await cells(shell, 50)
            eng.steps.clear()  # bounded on its own (_KEEP_STEPS); not what this measures
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            alive = [r() for r in refs if r() is not None]
            return len(refs), [r.id for r in alive], grown
        finally:
            await magics.shutdown()

    n, alive, grown = arun(main, timeout=120)
    assert n == 55 * ROWS_PER_CELL
    assert alive == [], f"{len(alive)} dropped rows still alive (ids {alive[:5]}...)"
    # What stays is each widget's saved state (a dict per row: what a reopened view
    # shows), each row's tag for its saved results (results.kept_tag: a %%generate
    # row's settings) and the widget's traitlets class: ~2.4-2.6 MB per 1,000 rows of
    # 20-row cells, all Python allocations counted (the rows themselves held it at
    # 6-7 MB of RSS).
    per_1000 = grown / (50 * ROWS_PER_CELL / 1000)
    assert per_1000 < 3.0e6, f"{per_1000 / 1e6:.1f} MB kept per 1,000 dropped rows"
