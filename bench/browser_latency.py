"""Kernel latency seen from a real browser while rows stream into an open token view.

A headless JupyterLab 4 (or Notebook 7, --app notebook) and Chromium (Playwright on
the system's /usr/bin/chromium; nothing is downloaded) open a notebook that loads a
model and starts --rows rows (greedy, --logprobs 5, so the token view has
probabilities to show) with one widget. Once they all decode, the token view of one
running row is opened (it asks the kernel for the row's new tokens every second) and,
while the rows decode, the page times a trivial cell again and again, two ways:

  cell    the notebook's own "run cell" command on a cell holding `1`, from the call
          until the front end has the reply (what a user's Shift+Enter waits for);
  kernel  an execute request `1` on the page's kernel connection, call to reply.

The same before the view opens, and after the run is stopped (the baseline). Prints
one JSON line per phase: median, p90 and max in ms, how many rows were decoding at
each sample, and the share of the phase the page spent in long tasks (main-thread
work over 50 ms). First, without a browser, the kernel's own share: how late the
event loop that runs the engine and the widget wakes from a 10 ms sleep.

  python -m bench browser-latency                    # the tiny model, 32 rows
  python -m bench browser-latency --model default    # the bundled SmolLM2
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import common

NAME, TITLE = "browser-latency", "Kernel latency from a browser, 32 rows streaming"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-dev-shm-usage"]

# One timed run of the trivial cell (the notebook's last), both ways, and the rows'
# states at that moment. `window.jupyterapp` is there with expose_app_in_browser.
TIME_JS = """async () => {
  const app = window.jupyterapp, panel = app.shell.currentWidget;
  const nb = panel.content, kernel = panel.sessionContext.session.kernel;
  nb.activeCellIndex = nb.widgets.length - 1;
  let t = performance.now();
  await app.commands.execute('notebook:run-cell');
  const cell = performance.now() - t;
  t = performance.now();
  await kernel.requestExecute({code: '1', silent: false, store_history: false}).done;
  const k = performance.now() - t;
  const states = [...document.querySelectorAll('.mlxnb-widget .mlxnb-row')].map((r) => r.dataset.state);
  return {cell, kernel: k, decoding: states.filter((s) => s === 'decode').length,
          open: !document.querySelector('.mlxnb-detail').hidden,
          tokens: document.querySelectorAll('.mlxnb-detail .mlxnb-tok').length};
}"""


def _jupyter():
    """tests/_jupyter.py (the isolated server the browser tests use)."""
    spec = importlib.util.spec_from_file_location("_bench_jupyter", common.ROOT / "tests" / "_jupyter.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _notebook(path: Path, model: str, rows: int, max_tokens: int) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    prompts = "\n".join(f"Row {i}: write about the number {i}." for i in range(rows))
    cells = ["%load_ext mlxnb", f"%mlxnb load {model} --max-batch {rows}",
             f"%%generate --max-tokens {max_tokens} --temp 0 --logprobs 5 --raw -o r\n{prompts}",
             "1"]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, path)


# Long tasks (main-thread work over 50 ms) the page ran, from a given time on: how
# busy rendering kept the page that also has to show the cell's reply.
LONG_JS = """() => { if (!window.__long) { window.__long = [];
  new PerformanceObserver((l) => window.__long.push(...l.getEntries().map((e) => [e.startTime, e.duration])))
    .observe({type: 'longtask', buffered: true}); } return performance.now(); }"""
BUSY_JS = """(t0) => { const now = performance.now();
  const ms = window.__long.filter(([t]) => t >= t0).reduce((a, [, d]) => a + d, 0);
  return {busy_share: +(ms / (now - t0)).toFixed(3), long_tasks: window.__long.filter(([t]) => t >= t0).length}; }"""


async def _loop_lag(model: str, rows: int, max_tokens: int, view: bool) -> dict:
    """The kernel's own share, without a browser: how late a 10 ms sleep wakes on the
    event loop that runs the engine's loop side and the widget (its messages dropped),
    every row decoding; with `view`, a token view's request every 100 ms."""
    from mlxnb import Engine
    from mlxnb.notebook.widget import GenerationWidget

    eng = Engine(model, warmup=False, max_batch=rows)
    run = eng.generate([f"Row {i}: write about the number {i}." for i in range(rows)],
                       max_tokens=max_tokens, chat=False, temperature=0, logprobs=5)
    w = GenerationWidget(eng, run.rows)
    w.comm.publish_msg = lambda *a, **k: None
    while not all(r.state == "decode" for r in run.rows):
        await asyncio.sleep(0.05)
    lags = []
    for i in range(200):
        if view and i % 10 == 0:
            r0 = run.rows[0]
            w._on_front_msg(w, {"type": "row_detail", "id": r0.id, "from": max(0, r0.ntok - 60)}, [])
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(1000 * (time.perf_counter() - t - 0.01))
    decoding = sum(r.state == "decode" for r in run.rows)
    await eng.aclose()
    return {"phase": f"kernel loop lag, {rows} rows decoding, widget" + (", token view asking" if view else ""),
            "n": len(lags), "lag": {"median_ms": round(statistics.median(lags), 2),
                                    "p90_ms": round(common.p90(lags), 2), "max_ms": round(max(lags), 1)},
            "decoding_rows_at_end": decoding, "load_avg_1m": round(os.getloadavg()[0], 1)}


def _summary(phase: str, samples: list, busy: dict | None = None) -> dict:
    out = {"phase": phase, "n": len(samples), **(busy or {})}
    for way in ("cell", "kernel"):
        xs = [s[way] for s in samples]
        out[way] = {"median_ms": round(statistics.median(xs), 1), "p90_ms": round(common.p90(xs), 1),
                    "max_ms": round(max(xs), 1)} if xs else None
    out["decoding_rows"] = sorted(set(s["decoding"] for s in samples))
    # other work on the machine's cores (other processes) shows up in every number here
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)
    out["token_view_tokens"] = [s["tokens"] for s in samples][-1:] if samples else []
    return out


def run(a) -> list:
    from playwright import sync_api

    jup = _jupyter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = tmp / "root"
        root.mkdir()
        if a.model == "tiny":
            from mlxnb.models.tiny import save_tiny_model

            model = str(save_tiny_model(tmp / "tiny"))
        else:
            model = "" if a.model == "default" else a.model
        _notebook(root / "latency.ipynb", model, a.rows, a.max_tokens)
        expose = ("--LabApp.expose_app_in_browser=True" if a.app == "lab"
                  else "--JupyterNotebookApp.expose_app_in_browser=True")
        url = "lab/tree/latency.ipynb" if a.app == "lab" else "notebooks/latency.ipynb"
        with contextlib.ExitStack() as stack:
            base, token = stack.enter_context(jup.jupyter_lab(root, tmp / "jupyter", app=a.app,
                                                              args=(expose,)))
            pw = stack.enter_context(sync_api.sync_playwright())
            ctx = pw.chromium.launch_persistent_context(
                str(tmp / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
                viewport={"width": 1280, "height": 1400})
            stack.callback(ctx.close)
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{base}/{url}?token={token}")
            select = page.locator(".jp-Dialog button", has_text="Select")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext")
            deadline = time.monotonic() + 90
            while not page.evaluate("() => { const k = window.jupyterapp.shell.currentWidget"
                                    ".sessionContext.session; return !!(k && k.kernel &&"
                                    " k.kernel.status === 'idle'); }"):
                if select.count():
                    select.first.click()
                assert time.monotonic() < deadline, "the notebook's kernel never became idle"
                page.wait_for_timeout(250)
            page.wait_for_timeout(500)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            states = "() => [...document.querySelectorAll('.mlxnb-widget .mlxnb-row')].map((r) => r.dataset.state)"
            deadline = time.monotonic() + 120
            outputs = ("() => [...document.querySelectorAll('.jp-OutputArea-output')]"
                       ".map((o) => o.innerText.slice(0, 300)).join(' | ')")
            while True:  # every row decoding
                s = page.evaluate(states)
                if len(s) == a.rows and s.count("decode") == a.rows:
                    break
                said = page.evaluate(outputs)
                assert time.monotonic() < deadline and "Error" not in said, \
                    f"the rows never all decoded: {s}; {said}"
                page.wait_for_timeout(100)

            page.evaluate(LONG_JS)

            def sample(all_decoding: bool) -> list:
                out, t0 = [], page.evaluate("() => performance.now()")
                while len(out) < a.samples:
                    r = page.evaluate(TIME_JS)
                    if all_decoding and r["decoding"] < a.rows:
                        break  # a row ended: the rest is not "every row decoding"
                    out.append(r)
                    page.wait_for_timeout(a.gap_ms)
                return out, page.evaluate(BUSY_JS, t0)

            closed = sample(True)
            page.locator(".mlxnb-widget .mlxnb-prompt").nth(0).click()  # the token view
            page.wait_for_function("() => document.querySelectorAll('.mlxnb-detail .mlxnb-tok').length > 0")
            viewing = sample(True)
            page.locator(".mlxnb-widget .mlxnb-stop-all").click()  # stop the run
            deadline = time.monotonic() + 60
            while any(x != "done" for x in page.evaluate(states)):
                assert time.monotonic() < deadline, "the rows never stopped"
                page.wait_for_timeout(250)
            page.wait_for_timeout(1000)
            idle = sample(False)
    return [_summary(f"{a.rows} rows decoding, no detail view", *closed),
            _summary(f"{a.rows} rows decoding, token view open", *viewing),
            _summary("rows stopped, token view open (baseline)", *idle)]


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--model", default="tiny",
                    help="tiny (random weights, saved to a temp dir), default (the bundled "
                         "SmolLM2), or a path / Hugging Face id")
    ap.add_argument("--app", default="lab", choices=["lab", "notebook"])
    ap.add_argument("--rows", type=common.count, default=32)
    ap.add_argument("--max-tokens", type=common.count, default=4000,
                    help="per row; enough that the rows outlast the samples (prompt + this "
                         "within the model's context: 4096 for the tiny model)")
    ap.add_argument("--samples", type=common.count, default=40)
    ap.add_argument("--gap-ms", type=int, default=100, help="pause between samples")
    common.add_output_args(ap)
    a = ap.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print(f"{CHROMIUM} not found (Debian: apt-get install chromium fonts-dejavu-core)",
              file=sys.stderr)
        return 2
    report = common.Report(NAME, "browser-latency", TITLE, a, argv)
    lines = []
    if a.model == "tiny":
        from mlxnb.models.tiny import save_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            path = str(save_tiny_model(Path(tmp) / "tiny"))
            for view in (False, True):
                lines.append(json.dumps(asyncio.run(_loop_lag(path, a.rows, a.max_tokens, view))))
                print(lines[-1], flush=True)
    for s in run(a):
        lines.append(json.dumps(s))
        print(lines[-1], flush=True)
    report.write("```\n" + "\n".join(lines) + "\n```", data={"phases": lines})
    return 0
