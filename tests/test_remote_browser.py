"""The widget in a real browser on rows served by mlx_lm.server: JupyterLab 4 + headless
Chromium run a notebook that connects to the server; every row streams to done, the
step and timeline charts draw, and the KV chart and the header say the server does
not report its KV use (mlx_lm.server publishes no /metrics). No console errors."""

from __future__ import annotations

import time

import pytest

from _jupyter import jupyter_lab
from test_browser_e2e import needs_browser, chromium_page, kernel_idle
from test_remote_server import mlx_lm_server

pytestmark = [pytest.mark.browser, pytest.mark.server]

SNAPSHOT_JS = """() => [...document.querySelectorAll('.mlxnb-widget')].map((w) => {
  const c = (k) => w.querySelector('canvas.mlxnb-chart-' + k) || {dataset: {}};
  return {rows: [...w.querySelectorAll('.mlxnb-row')].map((r) => r.dataset.state),
          text: w.textContent, kv: c('kv').dataset.reported,
          batch: c('step').dataset.batchReported, step: +(c('step').dataset.points || 0),
          timeline: +(c('timeline').dataset.points || 0)};
})"""


def test_widget_on_server_rows_in_jupyterlab(tmp_path):
    needs_browser(jupyter=False)
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from mlxnb.models.tiny import save_tiny_model

    t0 = time.monotonic()
    tiny = save_tiny_model(tmp_path / "tiny")
    root = tmp_path / "root"
    root.mkdir()
    errors: list = []
    with mlx_lm_server(tiny, tmp_path / "server.log") as (url, _):
        nb = new_notebook(cells=[new_code_cell(c) for c in [
            "%load_ext mlxnb", f"%mlxnb connect {url} --max-concurrency 4",
            "%%generate --max-tokens 400 -o a\nFirst row.\nSecond row.\nThird row.",
            "await a"]])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, root / "e2e.ipynb")  # the name kernel_idle() looks for
        with jupyter_lab(root, tmp_path / "jupyter") as (base, token):
            with chromium_page(tmp_path, height=900) as page:
                page.on("console", lambda m: errors.append(m.text)
                        if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(f"{base}/lab/tree/e2e.ipynb?token={token}")
                idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                select = page.locator(".jp-Dialog button", has_text="Select")
                while not (kernel_idle(base, token) and idle.count()):
                    assert time.monotonic() - t0 < 60, "the kernel never became idle"
                    if select.count():
                        select.first.click()
                    page.wait_for_timeout(250)
                page.wait_for_timeout(500)
                page.locator(".lm-MenuBar-item", has_text="Run").first.click()
                page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                             "li.lm-Menu-item[data-command='notebook:run-all-cells']"
                             ).first.click()
                while True:
                    w = page.evaluate(SNAPSHOT_JS)
                    if w and w[0]["rows"] and all(s == "done" for s in w[0]["rows"]):
                        break
                    assert time.monotonic() - t0 < 120, f"rows not done: {w}"
                    page.wait_for_timeout(300)
                page.wait_for_timeout(800)  # the final trait sync and a frame
                w = page.evaluate(SNAPSHOT_JS)[0]
                page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "w.png"))
    assert not errors, errors
    assert w["rows"] == ["done"] * 3
    assert w["kv"] == "0" and w["batch"] == "0"
    assert "KV: not reported by this server" in w["text"]
    assert w["step"] > 0 and w["timeline"] > 0
    print(f"screenshot: {tmp_path / 'w.png'}")
