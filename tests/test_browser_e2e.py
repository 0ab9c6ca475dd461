"""End to end in a real browser: JupyterLab 4 + headless Chromium (Playwright).

A notebook on the tiny random-weight model (saved as an mlx-lm directory) is opened
in JupyterLab and run with Run -> Run All Cells. Then, in the DOM:

(a) rows' token counts (`.mlxnb-row[data-ntok]`) keep growing while JupyterLab's
    kernel indicator reads idle: rows stream from the background task;
(b) every row reaches `data-state="done"`;
(c) the KV, step-time and timeline canvases have drawn data (`data-points` > 0);
(d) the page logged no console errors.

A screenshot of the dashboard widget lands in the test's tmp dir; it is also written
to docs/widget.png when that file is missing or MLXNB_UPDATE_DOCS=1 (so ordinary test
runs do not rewrite a committed image). Bounded: < 90 s, the server is always killed.
Uses Debian's Chromium at /usr/bin/chromium (never `playwright install`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from _jupyter import REPO, jupyter_lab

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
BUDGET_S = 90.0
DOCS_PNG = REPO / "docs" / "widget.png"

# Snapshot of everything the test looks at, read in one go so it is consistent.
SNAPSHOT_JS = """() => {
  const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
  const pts = (w, c) => +((w.querySelector('canvas.' + c) || {dataset: {}}).dataset.points || 0);
  const widgets = [...document.querySelectorAll('.mlxnb-widget')].map((w) => ({
    live: w.dataset.live,
    rows: [...w.querySelectorAll('.mlxnb-row')].map((r) => [r.dataset.state, +(r.dataset.ntok || 0)]),
    kv: pts(w, 'mlxnb-chart-kv'), step: pts(w, 'mlxnb-chart-step'),
    timeline: pts(w, 'mlxnb-chart-timeline'),
  }));
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
    .map((p) => p.textContent.trim());
  return {kernel: ind ? ind.dataset.status : null, widgets, prompts, t: performance.now() / 1000};
}"""


# The model the notebook runs: the tiny random model (fast; its "text" is random
# bytes), or with MLXNB_E2E_MODEL=default the bundled SmolLM2 (real text, slower:
# use it with MLXNB_UPDATE_DOCS=1 to refresh docs/widget.png).
E2E_MODEL = os.environ.get("MLXNB_E2E_MODEL", "tiny")


def notebook(tiny_dir: Path | None):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    if tiny_dir is not None:  # bytes at a few hundred tokens/s per row
        load, a_max, b_max = f"%mlxnb load {tiny_dir} --max-batch 16", "500,1500", "1000"
    else:  # the default model: ~5-20 tokens/s per row on a CPU
        load, a_max, b_max = "%mlxnb load", "32,64", "48"
    cells = [
        "%load_ext mlxnb",
        load,
        "%mlxnb dashboard",
        f"%%generate --max-tokens {a_max} -o a\n"
        "Write a haiku about the sea.\nExplain KV caches to a ten-year-old.\n"
        "Name three prime numbers.",
        "import asyncio\nawait asyncio.sleep(1.0)  # so the next rows visibly join later",
        f"%%generate --max-tokens {b_max} -o b\nCount to ten.\nSay hello politely.",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb, nbformat


def kernel_idle(base: str, token: str) -> bool:
    """The server has a session for e2e.ipynb whose kernel reports idle."""
    try:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=2) as r:
            sessions = json.load(r)
    except OSError:
        return False
    return any(s.get("path", "").endswith("e2e.ipynb")
               and (s.get("kernel") or {}).get("execution_state") == "idle" for s in sessions)


def test_widget_streams_in_jupyterlab(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found (Debian: apt-get install chromium "
                    "fonts-dejavu-core); this test never downloads a browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab")
    from mlxnb.tiny import save_tiny_model

    t_start = time.monotonic()

    def left() -> float:
        return BUDGET_S - (time.monotonic() - t_start)

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = notebook(save_tiny_model(tmp_path / "tiny") if E2E_MODEL == "tiny" else None)
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    snaps: list = []

    with jupyter_lab(root, tmp_path / "jupyter") as (base, token):
        with sync_api.sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                args=CHROME_FLAGS, viewport={"width": 1280, "height": 1100})
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.set_default_timeout(30_000)
                page.on("console", lambda m: errors.append(f"console: {m.text}")
                        if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
                page.goto(f"{base}/lab/tree/e2e.ipynb?token={token}")

                # JupyterLab 4.6 may ask for a kernel for a notebook without a session.
                # The indicator reads "idle" once before any kernel exists (a click on
                # Run All then is lost), so wait for the server's session to have an
                # idle kernel too, then for the page to show it.
                idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                select = page.locator(".jp-Dialog button", has_text="Select")
                while not (kernel_idle(base, token) and idle.count()):
                    assert left() > 30, "the notebook's kernel never became idle"
                    if select.count():
                        select.first.click()
                    page.wait_for_timeout(250)
                page.wait_for_timeout(500)
                assert idle.count()
                print(f"\nkernel ready {time.monotonic() - t_start:.1f} s into the test")

                page.locator(".lm-MenuBar-item", has_text="Run").first.click()
                # "Run All Cells" (the main menu's own command id, or the notebook's)
                page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                             "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()
                t_run = time.monotonic()

                def snap():
                    s = page.evaluate(SNAPSHOT_JS)
                    s["rows"] = [r for w in s["widgets"] for r in w["rows"]]
                    snaps.append(s)
                    return s

                def all_ran(s):  # every cell has an execution count, b's rows are shown
                    return (len(s["widgets"]) == 3 and len(s["widgets"][2]["rows"]) == 2
                            and all(p.strip("[]: ").isdigit() for p in s["prompts"]))

                # (a) streaming while the kernel is idle
                streaming = []
                streamed_png = tmp_path / "streaming.png"
                while True:
                    assert left() > 25, f"rows did not stream while idle; last: {snaps[-1:]}"
                    s = snap()
                    if all_ran(s) and s["kernel"] == "idle":
                        if not all(st == "done" for st, _ in s["rows"]):
                            streaming.append(s)
                            if len(streaming) == 2:
                                page.screenshot(path=str(streamed_png))
                        if len(streaming) >= 4 or all(st == "done" for st, _ in s["rows"]):
                            break
                    page.wait_for_timeout(300 if E2E_MODEL == "tiny" else 700)
                totals = [sum(n for _, n in s["rows"]) for s in streaming]
                print(f"\nwhile idle, total tokens in the DOM: {totals} over "
                      f"{streaming[-1]['t'] - streaming[0]['t']:.1f} s" if streaming else "")
                assert len(streaming) >= 3, (
                    f"too few idle snapshots with rows still running (raise max-tokens?): "
                    f"{[(s['kernel'], s['rows']) for s in snaps[-3:]]}")
                assert all(b >= a for a, b in zip(totals, totals[1:])), totals
                assert sum(b > a for a, b in zip(totals, totals[1:])) >= 2, totals

                # (b) every row finishes
                while True:
                    assert left() > 10, f"rows never all finished: {snaps[-1]['rows']}"
                    s = snap()
                    if s["rows"] and all(st == "done" for st, _ in s["rows"]):
                        break
                    page.wait_for_timeout(300)
                page.wait_for_timeout(500)  # final trait sync and one more frame
                s = snap()
                print(f"all rows done {time.monotonic() - t_run:.1f} s after Run All")
                assert len(s["rows"]) == 8 + 6 + 2  # dashboard + a + b
                bad = [(i, w["rows"]) for i, w in enumerate(s["widgets"])
                       if not all(st == "done" and n > 0 for st, n in w["rows"])]
                assert not bad, f"(widget, rows) not done or empty: {bad}"
                assert s["kernel"] == "idle"

                # (c) the charts drew data
                for i, w in enumerate(s["widgets"]):
                    assert w["kv"] > 0 and w["step"] > 0 and w["timeline"] > 0, (i, w)
                    assert w["live"] == "0", (i, w)

                dash = page.locator(".mlxnb-widget").first
                dash.scroll_into_view_if_needed()
                png = tmp_path / "widget.png"
                dash.screenshot(path=str(png))
            finally:
                ctx.close()

    # (d) no console errors
    assert not errors, "\n".join(errors)
    assert png.stat().st_size > 5000
    if not DOCS_PNG.exists() or os.environ.get("MLXNB_UPDATE_DOCS") == "1":
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copy(png, DOCS_PNG)
    print(f"screenshots: {png}, {streamed_png}; test took {time.monotonic() - t_start:.1f} s")
    assert time.monotonic() - t_start < BUDGET_S
