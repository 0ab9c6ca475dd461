"""End to end in a real browser: JupyterLab 4 (light theme) and Notebook 7 (dark
theme), each driven by headless Chromium (Playwright).

A notebook on the tiny random-weight model (saved as an mlx-lm directory) is opened
and run with Run -> Run All Cells. Then, in the DOM:

(a) rows' token counts (`.mlxnb-row[data-ntok]`) keep growing while the kernel is
    idle: rows stream from the background task;
(b) every row reaches `data-state="done"`; the canvases drew data; badges have at
    least 4.5:1 contrast on the theme;
(c) with the widget 600 px wide the text column is at least 40 % of it, and the
    numbers sit under the text;
(d) saved with default settings (no widget state), the kernel shut down and the
    notebook reopened: the widgets are gone ("model not found") and the results
    outputs show every finished row's text;
(e) the live phase logged no console errors.

Screenshots of each state land in the test's tmp dir; JupyterLab's, and Notebook 7's
dark widget, are also written to docs/ when missing or with MLXNB_UPDATE_DOCS=1
(ordinary runs do not rewrite committed images; MLXNB_E2E_MODEL=default makes them
with the bundled model's real text). Bounded in time; the server is always killed. Uses Debian's
Chromium at /usr/bin/chromium (never `playwright install`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from _jupyter import DARK_THEME, REPO, Deadline, jupyter_lab

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"


def needs_browser(app=None, jupyter: bool = True) -> None:
    """Skip unless Chromium and Playwright (and JupyterLab, or Notebook 7 for
    app="notebook") are installed; these tests never download a browser."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found (Debian: apt-get install chromium "
                    "fonts-dejavu-core); this test never downloads a browser")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if jupyter:
        pytest.importorskip("jupyterlab", reason="pip install jupyterlab")
    if app == "notebook":
        pytest.importorskip("notebook", reason="pip install notebook (Notebook 7)")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
BUDGET_S = 120.0


@contextlib.contextmanager
def chromium_page(tmp_path, height: int):
    """A page of a fresh headless Chromium profile, 1280 px wide (Playwright drives
    the system Chromium; nothing is downloaded)."""
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=CHROME_FLAGS, viewport={"width": 1280, "height": height})
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.set_default_timeout(30_000)
            yield page
        finally:
            ctx.close()

NB7_OWN_ERROR = "pageerror: Cannot read properties of undefined (reading 'schema')"
DOCS = REPO / "docs"

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
        load, a_max, b_max = f"%mlxnb load {tiny_dir} --max-batch 16", "800,2400", "1600"
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


# Per widget: [state, ntok, text] of each row; badge contrast on its own background.
DONE_JS = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).slice(0, 3).map(Number);
  const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  const lum = (s) => { const [r, g, b] = rgb(s); return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b); };
  const ratio = (a, b) => { const x = lum(a), y = lum(b); return (Math.max(x, y) + 0.05) / (Math.min(x, y) + 0.05); };
  const results = [...document.querySelectorAll('.mlxnb-results')];
  return [...document.querySelectorAll('.mlxnb-widget')].map((w, i) => ({
    results: results[i] ? results[i].getBoundingClientRect().height : null,
    theme: w.dataset.theme,
    rows: [...w.querySelectorAll('.mlxnb-row')].map((r) => [r.dataset.state,
      r.querySelector('.mlxnb-text-inner').textContent]),
    contrast: Math.min(...[...w.querySelectorAll('.mlxnb-badge')].map((b) => {
      const cs = getComputedStyle(b); return ratio(cs.color, cs.backgroundColor); })),
  }));
}"""

# Widths of the first widget and of its rows' parts, for the layout check.
LAYOUT_JS = """() => {
  const w = document.querySelector('.mlxnb-widget');
  const r = w.querySelector('.mlxnb-row');
  const box = (s) => r.querySelector(s).getBoundingClientRect();
  return {layout: w.dataset.layout, widget: w.getBoundingClientRect().width,
          text: box('.mlxnb-text').width, textTop: box('.mlxnb-text').top,
          ntokTop: box('.mlxnb-ntok').top, textBottom: box('.mlxnb-text').bottom};
}"""

# After reopening: what the widget outputs say, and the results outputs' visible text.
REOPENED_JS = """() => ({
  widgets: document.querySelectorAll('.mlxnb-widget').length,
  first: [...document.querySelectorAll('.jp-CodeCell')].slice(1).map((c) =>
    (c.querySelector('.jp-OutputArea-output') || {}).textContent),
  errors: [...document.querySelectorAll('.jp-OutputArea-output')]
    .map((o) => o.textContent).filter((t) => t.includes('Error displaying widget')).length,
  results: [...document.querySelectorAll('.mlxnb-results')].map((e) => ({
    h: e.getBoundingClientRect().height, text: e.innerText,
    done: +e.dataset.done, rows: +e.dataset.rows})),
})"""


def _clean(s: str) -> str:
    """Whitespace runs to one space, control and replacement characters dropped (the
    tiny model writes random bytes; HTML parsing and the DOM treat those differently)."""
    s = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd\u2026]", "", s)
    return " ".join(s.split())


def _open(page, base, token, app, left):
    """Open e2e.ipynb and wait until its kernel is idle (answering a kernel dialog)."""
    url = (f"{base}/lab/tree/e2e.ipynb?token={token}" if app == "lab"
           else f"{base}/notebooks/e2e.ipynb?token={token}")
    page.goto(url)
    # JupyterLab 4.6 may ask for a kernel for a notebook without a session. An
    # indicator reads "idle" once before any kernel exists (a click on Run All then is
    # lost), so wait for the server's session to have an idle kernel too.
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                        ".jp-Toolbar-kernelStatus[data-status='idle']")
    select = page.locator(".jp-Dialog button", has_text="Select")
    while not (kernel_idle(base, token) and (app != "lab" or idle.count())):
        assert left() > 20, "the notebook's kernel never became idle"
        if select.count():
            select.first.click()
        page.wait_for_timeout(250)
    page.locator(".jp-Notebook").first.wait_for()
    page.wait_for_timeout(800)


def _saved(path) -> dict:
    """The notebook on disk, or {} while the server is still writing it."""
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def _sessions(base, token):
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
        return json.load(r)


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_widget_in_jupyterlab_and_notebook7(tmp_path, app):
    needs_browser(app)
    from mlxnb.models.tiny import save_tiny_model

    clock = Deadline(BUDGET_S)
    left = clock.left

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = notebook(save_tiny_model(tmp_path / "tiny") if E2E_MODEL == "tiny" else None)
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    snaps: list = []
    shots = {}
    dark = app == "notebook"

    with jupyter_lab(root, tmp_path / "jupyter", app=app,
                     settings=DARK_THEME if dark else None) as (base, token):
        with chromium_page(tmp_path, height=1100) as page:
            live_phase = [True]
            later: list = []  # errors after the reopen, printed only
            page.on("console", lambda m: (errors if live_phase[0] else later).append(
                f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: (errors if live_phase[0] else later).append(
                f"pageerror: {e}"))
            _open(page, base, token, app, left)
            print(f"\n[{app}] kernel ready {clock.spent():.1f} s into the test")

            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            # "Run All Cells" (the main menu's own command id, or the notebook's)
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                         "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()
            t_run = time.monotonic()

            def snap():
                s = page.evaluate(SNAPSHOT_JS)
                if s["kernel"] is None:  # no indicator in the DOM: ask the server
                    s["kernel"] = "idle" if kernel_idle(base, token) else "busy"
                s["rows"] = [r for w in s["widgets"] for r in w["rows"]]
                snaps.append(s)
                return s

            def all_ran(s):  # every cell has an execution count, b's rows are shown
                return (len(s["widgets"]) == 3 and len(s["widgets"][2]["rows"]) == 2
                        and all(p.strip("[]: ").isdigit() for p in s["prompts"]))

            # (a) streaming while the kernel is idle
            streaming = []
            while True:
                assert left() > 60, f"rows did not stream while idle; last: {snaps[-1:]}"
                s = snap()
                if all_ran(s) and s["kernel"] == "idle":
                    # rows still running that have started to stream
                    if not all(st == "done" for st, _ in s["rows"]) and \
                            sum(n for _, n in s["rows"]):
                        streaming.append(s)
                        if len(streaming) == 2:
                            shots["streaming"] = tmp_path / "streaming.png"
                            page.screenshot(path=str(shots["streaming"]))
                    if len(streaming) >= 4 or all(st == "done" for st, _ in s["rows"]):
                        break
                page.wait_for_timeout(300 if E2E_MODEL == "tiny" else 700)
            totals = [sum(n for _, n in s["rows"]) for s in streaming]
            print(f"[{app}] while idle, total tokens in the DOM: {totals} over "
                  f"{streaming[-1]['t'] - streaming[0]['t']:.1f} s" if streaming else "")
            assert len(streaming) >= 3, (
                f"too few idle snapshots with rows still running (raise max-tokens?): "
                f"{[(s['kernel'], s['rows']) for s in snaps[-3:]]}")
            assert all(b >= a for a, b in zip(totals, totals[1:])), totals
            assert sum(b > a for a, b in zip(totals, totals[1:])) >= 2, totals

            # (b) every row finishes; charts drew; badges readable on this theme
            while True:
                assert left() > 45, f"rows never all finished: {snaps[-1]['rows']}"
                s = snap()
                if s["rows"] and all(st == "done" for st, _ in s["rows"]):
                    break
                page.wait_for_timeout(300)
            page.wait_for_timeout(700)  # final trait sync and one more frame
            s = snap()
            print(f"[{app}] all rows done {time.monotonic() - t_run:.1f} s after Run All")
            assert len(s["rows"]) == 8 + 6 + 2  # dashboard + a + b
            bad = [(i, w["rows"]) for i, w in enumerate(s["widgets"])
                   if not all(st == "done" and n > 0 for st, n in w["rows"])]
            assert not bad, f"(widget, rows) not done or empty: {bad}"
            assert s["kernel"] == "idle"
            for i, w in enumerate(s["widgets"]):
                assert w["kv"] > 0 and w["step"] > 0 and w["timeline"] > 0, (i, w)
                assert w["live"] == "0", (i, w)
            done = page.evaluate(DONE_JS)
            assert [w["theme"] for w in done] == ["dark" if dark else "light"] * 3
            assert min(w["contrast"] for w in done) >= 4.5, done
            # each widget's results output is there, hidden beside the live widget
            assert [w["results"] for w in done] == [0, 0, 0], done
            texts = [_clean(t)[:60] for w in done[1:] for _, t in w["rows"]]
            assert len(texts) == 8 and all(texts), texts
            dash = page.locator(".mlxnb-widget").first
            dash.scroll_into_view_if_needed()
            shots["widget"] = tmp_path / "widget.png"
            dash.screenshot(path=str(shots["widget"]))

            # (c) a 600 px widget: the text column keeps >= 40 %, numbers under it
            lay, vw = page.evaluate(LAYOUT_JS), 1280
            for _ in range(4):  # the page's margins need not scale linearly
                if abs(lay["widget"] - 600) <= 20:
                    break
                vw = round(vw + 600 - lay["widget"])
                page.set_viewport_size({"width": vw, "height": 1100})
                page.wait_for_timeout(500)
                lay = page.evaluate(LAYOUT_JS)
            print(f"[{app}] layout with a {vw} px viewport: {lay}")
            assert abs(lay["widget"] - 600) <= 40, lay
            assert lay["layout"] == "medium" and lay["text"] >= 0.4 * lay["widget"], lay
            assert lay["ntokTop"] >= lay["textBottom"] - 1, lay  # numbers under the text
            shots["narrow"] = tmp_path / "widget-600px.png"
            dash.screenshot(path=str(shots["narrow"]))
            page.set_viewport_size({"width": 1280, "height": 1100})
            live_phase[0] = False

            # (d) save (default settings: no widget state), shut down, reopen
            page.locator(".jp-Notebook").first.click()
            page.keyboard.press("Control+s")
            saved = None
            for _ in range(40):
                page.wait_for_timeout(250)
                on_disk = _saved(root / "e2e.ipynb")
                outs = [o for c in on_disk.get("cells", []) for o in c.get("outputs", [])]
                saved = [o["data"]["text/html"] for o in outs
                         if "mlxnb-results" in "".join(o.get("data", {}).get("text/html", ""))]
                if len(saved) == 3:
                    break
            assert saved and len(saved) == 3, "the saved notebook lacks results outputs"
            assert "widgets" not in on_disk["metadata"] or not on_disk["metadata"][
                "widgets"].get("application/vnd.jupyter.widget-state+json", {}).get("state")
            for sess in _sessions(base, token):
                req = urllib.request.Request(
                    f"{base}/api/sessions/{sess['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
            _open(page, base, token, app, left)
            for _ in range(40):
                re_ = page.evaluate(REOPENED_JS)
                if len(re_["results"]) == 3 and re_["errors"] == 3:
                    break
                page.wait_for_timeout(250)
            print(f"[{app}] reopened, the widget outputs read: {re_['first']}")
            print(f"[{app}] reopened: {re_['widgets']} widgets, {re_['errors']} "
                  f"'Error displaying widget' outputs, results "
                  f"{[(r['done'], r['rows'], round(r['h'])) for r in re_['results']]}")
            assert re_["widgets"] == 0 and len(re_["results"]) == 3, re_
            assert all(r["h"] > 20 and r["done"] == r["rows"] for r in re_["results"])
            shown = _clean(" ".join(r["text"] for r in re_["results"][1:]))
            missing = [t for t in texts if t not in shown]
            assert not missing, (missing, shown[:2000])
            cell = page.locator(".jp-CodeCell").nth(3)  # the `a` cell
            cell.evaluate("(e) => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(300)
            box = cell.bounding_box()
            shots["reopened"] = tmp_path / "reopened.png"
            page.screenshot(path=str(shots["reopened"]), clip={
                "x": box["x"], "y": max(0, box["y"]), "width": box["width"],
                "height": min(box["height"], 560)})

    # (e) no console errors while live (after reopening, the widget manager logs
    # "model not found" for each widget output: expected)
    print(f"[{app}] console after the reopen: {later}")
    # Notebook 7.6 itself throws this on opening any notebook (measured: a notebook
    # holding only `1+1`, no widgets, no user settings).
    errors = [e for e in errors if not (app == "notebook" and e == NB7_OWN_ERROR)]
    assert not errors, "\n".join(errors)
    for name, png in shots.items():
        assert png.stat().st_size > 3000, png
    # JupyterLab's every state; Notebook 7's widget in its dark theme
    names = ({"streaming": "streaming.png", "widget": "widget.png",
              "narrow": "widget-600px.png", "reopened": "reopened.png"} if app == "lab"
             else {"widget": "widget-dark-notebook7.png"})
    for name, png in shots.items():
        dest = DOCS / names[name] if name in names else None
        if dest and (not dest.exists() or os.environ.get("MLXNB_UPDATE_DOCS") == "1"):
            DOCS.mkdir(exist_ok=True)
            shutil.copy(png, dest)
    print(f"[{app}] screenshots: {sorted(str(p) for p in shots.values())}; "
          f"test took {clock.spent():.1f} s")
    assert clock.spent() < BUDGET_S


SAVE_WIDGET_STATE = {"@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings":
                     {"saveState": True}}

STALE_JS = """() => [...document.querySelectorAll('.mlxnb-widget')].map((w) => ({
  live: w.dataset.live, stats: w.querySelector('.mlxnb-stats').textContent,
  badges: [...w.querySelectorAll('.mlxnb-badge')].map((b) => b.textContent),
  stops: [...w.querySelectorAll('.mlxnb-stop')].map((b) => getComputedStyle(b).visibility),
  stopAll: getComputedStyle(w.querySelector('.mlxnb-stop-all')).display,
}))"""


def test_saved_widget_state_of_an_unfinished_run_reads_not_live(tmp_path):
    """With "Save Widget State Automatically" on, a notebook saved while rows decode
    and reopened after its kernel is gone shows the saved widget; once no kernel
    answers its sync request, it says "not live", its rows "unfinished", and it has
    no stop buttons."""
    needs_browser()
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from mlxnb.models.tiny import save_tiny_model

    clock = Deadline(BUDGET_S)
    left = clock.left

    root = tmp_path / "root"
    root.mkdir()
    tiny = save_tiny_model(tmp_path / "tiny")
    nb = new_notebook(cells=[new_code_cell(c) for c in [
        "%load_ext mlxnb", f"%mlxnb load {tiny} --max-batch 4",
        "%%generate --max-tokens 3500 --raw -o long\nhello\nworld"]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, root / "e2e.ipynb")
    with jupyter_lab(root, tmp_path / "jupyter", settings=SAVE_WIDGET_STATE) as (base, token):
        with chromium_page(tmp_path, height=900) as page:
            _open(page, base, token, "lab", left)
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                         "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()
            while True:  # rows decoding: save now
                assert left() > 40, "rows never started decoding"
                w = page.evaluate(STALE_JS)
                if w and w[0]["badges"] == ["decoding", "decoding"]:
                    break
                page.wait_for_timeout(250)
            assert w[0]["live"] == "1" and w[0]["stopAll"] != "none", w
            page.locator(".jp-Notebook").first.click()
            page.keyboard.press("Control+s")
            for _ in range(40):
                page.wait_for_timeout(250)
                meta = _saved(root / "e2e.ipynb").get("metadata", {})
                if meta.get("widgets"):
                    break
            assert meta.get("widgets"), "widget state was not saved"
            for sess in _sessions(base, token):
                req = urllib.request.Request(
                    f"{base}/api/sessions/{sess['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
            _open(page, base, token, "lab", left)
            seen = []
            while True:
                assert left() > 5, f"the restored widget never read not live: {seen[-1:]}"
                w = page.evaluate(STALE_JS)
                seen.append(w)
                if w and w[0]["live"] == "stale":
                    break
                page.wait_for_timeout(500)
            print(f"\nrestored widget, first: {seen[0]}\nthen: {w}")
            assert seen[0] and seen[0][0]["live"] == "1"  # the saved state said live
            [v] = w
            assert v["badges"] == ["unfinished", "unfinished"], v
            assert "not live" in v["stats"] and "running" not in v["stats"], v
            assert v["stops"] == ["hidden", "hidden"] and v["stopAll"] == "none", v
            shot = tmp_path / "not-live.png"
            page.locator(".mlxnb-widget").first.screenshot(path=str(shot))
    dest = DOCS / "not-live.png"
    if not dest.exists() or os.environ.get("MLXNB_UPDATE_DOCS") == "1":
        shutil.copy(shot, dest)
    print(f"took {clock.spent():.1f} s")
