"""In a real browser (JupyterLab 4 light, Notebook 7 dark; headless Chromium driven by
Playwright), what the widget shows while rows run and after the kernel goes away:

(a) a JSON row cut by --max-tokens reads "invalid" in a badge of its own colour that
    fits its column, and the reason is written on the row (not only in a tooltip);
(b) 40 rows from one template, 7 at a time: every running row is in the 12-row window,
    also once the first twelve have finished; the prompt column shows each row's own
    part of the template (the shared head elided);
(c) the step chart's key names the prefill marks, and a run's steps count from 1;
(d) Kernel > Shut Down Kernel while rows decode: within seconds the widget says not
    live, no longer "running", and its stop buttons are gone or disabled.

Uses Debian's Chromium at /usr/bin/chromium (never `playwright install`); bounded in
time; the server is always killed.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from _jupyter import DARK_THEME, jupyter_lab
from test_browser_e2e import CHROMIUM, DOCS, NB7_OWN_ERROR, _open, chromium_page

pytestmark = pytest.mark.browser
BUDGET_S = 150.0

# Per widget: its title, header, step-chart key and x axis base, and per row what a
# reader sees (hidden or not, badge text and whether the badge is cut, verdict, prompt).
VIEW_JS = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).slice(0, 4).map(Number);
  const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  const lum = ([r, g, b]) => 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
  const back = (e) => { for (; e; e = e.parentElement) { const c = rgb(getComputedStyle(e).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0)) return c.slice(0, 3); } return [255, 255, 255]; };
  const ratio = (e) => { const a = lum(rgb(getComputedStyle(e).color)), b = lum(back(e));
    return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05); };
  return [...document.querySelectorAll('.mlxnb-widget')].map((w) => ({
  title: w.querySelector('.mlxnb-title').textContent,
  live: w.dataset.live, stale: w.dataset.stale || '',
  stats: w.querySelector('.mlxnb-stats').textContent,
  key: w.querySelector('.mlxnb-legend') ? w.querySelector('.mlxnb-legend').innerText : '',
  stopAll: (() => { const b = w.querySelector('.mlxnb-stop-all');
    return getComputedStyle(b).display === 'none' ? 'hidden' : b.disabled ? 'disabled' : 'on'; })(),
  rows: [...w.querySelectorAll('.mlxnb-row')].map((r) => {
    const b = r.querySelector('.mlxnb-badge'), v = r.querySelector('.mlxnb-verdict');
    const stop = r.querySelector('.mlxnb-stop');
    return {
      id: +r.dataset.id, state: r.dataset.state, shown: r.offsetParent !== null,
      badge: b.textContent, kind: b.dataset.kind, badgeCut: b.scrollWidth > b.clientWidth + 1,
      badgeBg: getComputedStyle(b).backgroundColor,
      verdict: v ? v.textContent : '', verdictW: v ? v.getBoundingClientRect().width : 0,
      verdictContrast: v && v.textContent ? ratio(v) : null,
      prompt: r.querySelector('.mlxnb-prompt').textContent,
      stop: getComputedStyle(stop).visibility === 'hidden' ? 'hidden' : stop.disabled ? 'disabled' : 'on',
    };
  }),
  keyContrast: Math.min(...[...w.querySelectorAll('.mlxnb-legend .mlxnb-key')].map(ratio)),
}));
}"""


def _to_docs(png, name):
    """Screenshots go to docs/ when missing there or with MLXNB_UPDATE_DOCS=1."""
    dest = DOCS / name
    if png.exists() and (not dest.exists() or os.environ.get("MLXNB_UPDATE_DOCS") == "1"):
        DOCS.mkdir(exist_ok=True)
        shutil.copy(png, dest)


def _notebook(tiny):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        "%load_ext mlxnb",
        f"%mlxnb load {tiny} --max-batch 7",
        'schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 8}}, "required": ["name"]}\n'
        'names = [f"student {i:02d}" for i in range(40)]',
        "%%generate --json-schema schema --max-tokens 2 --raw -o js\nName a person.",
        "%%generate --max-tokens 160 --raw -o many\n"
        "Extract the person's name from this sentence: {names} wrote the program. Answer briefly.",
        "%%generate --max-tokens 3500 --raw -o long\nhello\nworld",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb, nbformat


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_validity_running_rows_prompts_and_kernel_shutdown(tmp_path, app):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found; this test never downloads a browser")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab")
    if app == "notebook":
        pytest.importorskip("notebook", reason="pip install notebook (Notebook 7)")
    from mlxnb.models.tiny import save_tiny_model

    t_start = time.monotonic()

    def left() -> float:
        return BUDGET_S - (time.monotonic() - t_start)

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = _notebook(save_tiny_model(tmp_path / "tiny"))
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    dark = app == "notebook"
    with jupyter_lab(root, tmp_path / "jupyter", app=app,
                     settings=DARK_THEME if dark else None) as (base, token):
        with chromium_page(tmp_path, height=2400) as page:
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            _open(page, base, token, app, left)
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                         "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()

            # (b) while the 40 rows run: running rows always in the window
            samples, late = [], 0
            while True:
                assert left() > 60, f"the 40 rows never finished: {samples[-1:]}"
                ws = page.evaluate(VIEW_JS)
                if len(ws) >= 2 and len(ws[1]["rows"]) == 40:
                    rows = ws[1]["rows"]
                    samples.append(rows)
                    running = [r for r in rows if r["state"] in ("prefill", "decode")]
                    hidden = [r["id"] for r in running if not r["shown"]]
                    assert not hidden, f"running rows off screen: {hidden}"
                    assert sum(r["shown"] for r in rows) <= 12
                    # the case that hid them before: rows beyond the first twelve running
                    late += any(i >= 12 for i in [rows.index(r) for r in running])
                    if all(r["state"] == "done" for r in rows):
                        break
                page.wait_for_timeout(100)
            print(f"\n[{app}] {len(samples)} samples of the 40 rows, {late} with rows "
                  f"past the twelfth running")
            assert late >= 2, "no sample caught rows past the twelfth running"

            ws = page.evaluate(VIEW_JS)
            js_w, many = ws[0], ws[1]
            # (a) the cut JSON row: its own badge, not cut, the reason on the row
            [row] = js_w["rows"]
            print(f"[{app}] JSON row: {row}")
            assert row["state"] == "done" and row["kind"] == "invalid", row
            assert row["badge"] == "invalid: length" and not row["badgeCut"], row
            assert row["verdict"].startswith("json ✗") and "max-tokens" in row["verdict"], row
            assert row["verdictW"] > 40, row  # visible on the row, not only a tooltip
            assert row["verdictContrast"] >= 4.5 and js_w["keyContrast"] >= 4.5, js_w
            done_bg = [r["badgeBg"] for r in many["rows"] if r["kind"] == "done"]
            assert done_bg and row["badgeBg"] != done_bg[0]
            assert js_w["title"] == "-o js"
            # (b) prompts: each row's own part of the template
            prompts = [r["prompt"] for r in many["rows"]]
            assert len(set(prompts)) == 40, prompts[:3]
            assert all(p.startswith(f"…student {i:02d} ") for i, p in enumerate(prompts)), prompts[:3]
            # (c) the step chart's key and a run's steps from 1
            assert "prefill" in many["key"], many["key"]
            axis = page.evaluate("() => [...document.querySelectorAll('.mlxnb-chart-step')]"
                                 ".map((c) => c.dataset.points)")
            assert all(int(a) > 0 for a in axis), axis
            page.locator(".mlxnb-widget").nth(1).screenshot(path=str(tmp_path / "many.png"))
            page.locator(".mlxnb-widget").nth(0).screenshot(path=str(tmp_path / "invalid.png"))
            _to_docs(tmp_path / "invalid.png", f"invalid-row{'-dark' if dark else ''}.png")
            _to_docs(tmp_path / "many.png", f"running-rows{'-dark' if dark else ''}.png")

            # (d) the long rows decode; shut the kernel down from the menu
            while True:
                assert left() > 25, "the long rows never decoded"
                ws = page.evaluate(VIEW_JS)
                long_w = ws[2] if len(ws) == 3 else {"rows": []}
                if [r["state"] for r in long_w["rows"]] == ["decode", "decode"]:
                    break
                page.wait_for_timeout(200)
            assert long_w["live"] == "1" and long_w["stopAll"] == "on", long_w
            assert "running" in long_w["stats"]
            page.locator(".lm-MenuBar-item", has_text="Kernel").first.click()
            page.locator("li.lm-Menu-item[data-command='kernelmenu:shutdown']").first.click()
            t_shut = time.monotonic()
            accept = page.locator(".jp-Dialog .jp-mod-accept")
            seen = []
            while True:
                assert left() > 5, f"the widget never read not live: {seen[-1:]}"
                if accept.count():
                    accept.first.click()
                    t_shut = time.monotonic()
                long_w = page.evaluate(VIEW_JS)[2]
                seen.append(long_w)
                if long_w["live"] == "stale":
                    break
                page.wait_for_timeout(200)
            took = time.monotonic() - t_shut
            print(f"[{app}] not live {took:.1f} s after the shutdown: {long_w['stats']}")
            assert took < 8.0, took
            assert long_w["stale"] == "kernel", long_w
            assert "not live" in long_w["stats"] and "running" not in long_w["stats"], long_w
            assert "tok/s" not in long_w["stats"].split("not live")[0] or \
                "engine" not in long_w["stats"], long_w
            assert long_w["stopAll"] in ("hidden", "disabled"), long_w
            assert all(r["stop"] in ("hidden", "disabled") for r in long_w["rows"]), long_w
            assert [r["badge"] for r in long_w["rows"]] == ["unfinished", "unfinished"]
            page.locator(".mlxnb-widget").nth(2).screenshot(path=str(tmp_path / "shutdown.png"))
            _to_docs(tmp_path / "shutdown.png", f"kernel-shut-down{'-dark' if dark else ''}.png")
    errors = [e for e in errors if not (app == "notebook" and e == NB7_OWN_ERROR)]
    assert not errors, "\n".join(errors)
    assert time.monotonic() - t_start < BUDGET_S


SAVE_WIDGET_STATE = {"@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings":
                     {"saveState": True}}

DETAIL_JS = """() => { const w = document.querySelector('.mlxnb-widget');
  const d = w.querySelector('.mlxnb-detail');
  return {hidden: d.hidden, kind: d.dataset.kind || '', trace: d.dataset.trace || '',
    title: d.querySelector('.mlxnb-detail-title').textContent,
    wf: [...d.querySelectorAll('.mlxnb-wf-row')].map((r) => [r.dataset.phase,
      r.querySelector('.mlxnb-wf-label').textContent, r.querySelector('.mlxnb-wf-text').textContent]),
    toks: [...d.querySelectorAll('.mlxnb-tok')].map((t) => [t.textContent, t.dataset.p]),
    info: (d.querySelector('.mlxnb-tokinfo') || {}).textContent || '',
    steps: [...d.querySelectorAll('.mlxnb-step-lines li')].map((l) => l.textContent),
    note: [...d.querySelectorAll('.mlxnb-detail-note')].map((n) => n.textContent).join(' | '),
    states: [...w.querySelectorAll('.mlxnb-row')].map((r) => r.dataset.state)};
}"""


def _detail_notebook(tiny):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        "%load_ext mlxnb",
        f"%mlxnb load {tiny} --max-batch 2",
        # the regex keeps the random model from ending rows early (its end-of-text
        # token is masked until 600 letters are out): rows decode for seconds
        "%%generate --max-tokens 700 --regex '[a-z]{{600}}' --logprobs 3 --temp 0.8 --raw -o r\n"
        "hello there\nsecond prompt\nthe third row waits for a slot\nfour",
        "import json, math\nawait r\neng = r.rows[0]._canceller().__self__\n"
        "json.dump({'p0': math.exp(r.rows[0].logprobs[0]['logprob']),\n"
        "           'ntok0': r.rows[0].ntok, 'ntoks': [x.ntok for x in r.rows],\n"
        "           'why2': r.rows[2].trace[0]['why'],\n"
        "           'decode2': [p for p in r.rows[2].trace if p['phase'] == 'decode'][0]['tokens'],\n"
        "           'step0': r.widget.header['step0'],\n"
        "           'steps': {s.step: [list(s.batch_ids), list(s.ended)] for s in eng.steps}},\n"
        "          open('expected.json', 'w'))",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb, nbformat


def test_detail_views_live_and_from_a_saved_notebook(tmp_path):
    """Open the row view (life + tokens) and the step inspector on a live run, check
    their numbers against the Python side; save with widget state, reopen with no
    kernel: the rows opened live still show their tokens and life."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found; this test never downloads a browser")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab")
    import json

    from mlxnb.models.tiny import save_tiny_model
    from test_browser_e2e import _saved, _sessions

    import urllib.request

    t_start = time.monotonic()

    def left() -> float:
        return BUDGET_S - (time.monotonic() - t_start)

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = _detail_notebook(save_tiny_model(tmp_path / "tiny"))
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    with jupyter_lab(root, tmp_path / "jupyter", settings=SAVE_WIDGET_STATE) as (base, token):
        with chromium_page(tmp_path, height=1400) as page:
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            _open(page, base, token, "lab", left)
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                         "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()
            prompts = page.locator(".mlxnb-widget .mlxnb-prompt")
            d = None
            while True:  # open a row while it decodes: its life grows live
                assert left() > 90, f"rows never decoded: {d}"
                if prompts.count() == 4:
                    d = page.evaluate(DETAIL_JS)
                    if "decode" in d["states"]:
                        break
                page.wait_for_timeout(50)
            opened = d["states"].index("decode")
            prompts.nth(opened).click()
            live = []
            for _ in range(40):
                page.wait_for_timeout(150)
                live.append(page.evaluate(DETAIL_JS))
                if live[-1]["toks"]:
                    break
            d = live[-1]
            print(f"\nlive row view: {d['title']} {d['wf']} {len(d['toks'])} tokens")
            assert not d["hidden"] and d["kind"] == "row" and d["trace"] == "kernel", d
            assert d["toks"] and all(p is not None for _, p in d["toks"]), d["toks"][:3]
            while not (root / "expected.json").exists():
                assert left() > 60, "the run never finished"
                page.wait_for_timeout(200)
            page.wait_for_timeout(500)
            exp = json.loads((root / "expected.json").read_text())
            print(f"python side: { {k: v for k, v in exp.items() if k != 'steps'} }")

            # the view opened live kept up (the rest of the tokens as they came, and
            # its last ones when the row ended): all of them, in order
            for _ in range(30):
                d = page.evaluate(DETAIL_JS)
                if len(d["toks"]) == exp["ntoks"][opened] and d["wf"][-1][0] == "finish":
                    break
                page.wait_for_timeout(150)
            assert len(d["toks"]) == exp["ntoks"][opened], (len(d["toks"]), exp["ntoks"])
            assert d["wf"][-1][0] == "finish", d["wf"]
            # row 0 again, finished: token 0's probability as the sampler gave it
            prompts.nth(0).click()  # (unpins) and again: opens with fresh data
            prompts.nth(0).click()
            for _ in range(40):
                page.wait_for_timeout(150)
                d = page.evaluate(DETAIL_JS)
                if len(d["toks"]) == exp["ntok0"]:
                    break
            assert len(d["toks"]) == exp["ntok0"], (len(d["toks"]), exp)
            assert abs(float(d["toks"][0][1]) - exp["p0"]) < 1e-4, (d["toks"][0], exp)
            page.locator(".mlxnb-tok").first.hover()
            info = page.evaluate(DETAIL_JS)["info"]
            m = re.search(r"p = ([\d.]+)%", info)
            if "p = <0.1%" in info:
                assert exp["p0"] < 0.001, (info, exp["p0"])
            else:
                assert m and abs(float(m.group(1)) - 100 * exp["p0"]) <= 0.051, (info, exp["p0"])
            assert "temperature 0.8" in info, info
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "tokens.png"))
            _to_docs(tmp_path / "tokens.png", "token-view.png")
            page.locator(".mlxnb-tokens").first.focus()
            page.keyboard.press("ArrowRight")
            page.keyboard.press("ArrowRight")
            assert page.evaluate(DETAIL_JS)["info"].startswith("token 3:") or \
                page.evaluate(DETAIL_JS)["info"].startswith("token 2:")

            # row 2 queued on the full batch (2 slots): its life says so
            prompts.nth(2).click()
            for _ in range(40):
                page.wait_for_timeout(150)
                d = page.evaluate(DETAIL_JS)
                if d["trace"] == "kernel" and "3" in d["title"] or d["title"].startswith("row 2"):
                    if d["wf"] and d["trace"] == "kernel":
                        break
            wf = {phase: text for phase, _, text in d["wf"]}
            print(f"row 2: {d['wf']}")
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "row-life.png"))
            _to_docs(tmp_path / "row-life.png", "row-life.png")
            assert exp["why2"] == ["batch full"] and "(batch full)" in wf["queued"], wf
            assert wf["decode"].startswith(f"{exp['decode2']} tokens"), (wf, exp)
            assert any(p == "prefill" for p, _, _ in d["wf"])

            # the step inspector, by keyboard: Enter opens the last step
            page.locator(".mlxnb-chart-step").first.focus()
            page.keyboard.press("Enter")
            for _ in range(40):
                page.wait_for_timeout(150)
                d = page.evaluate(DETAIL_JS)
                if d["steps"]:
                    break
            # each step shown, checked against the engine's record of it; arrow keys
            # walk back until a step in which rows decoded and one ended
            seen = []
            for _ in range(60):
                lines = page.evaluate(DETAIL_JS)["steps"]
                m = re.match(r"step (\d+) of this run \(engine step (\d+)\)", lines[0])
                assert m, lines
                n = int(m.group(2))
                assert int(m.group(1)) == n - exp["step0"], lines
                batch, ended = exp["steps"][str(n)]
                assert lines[1] == ("decoding: " + ", ".join(f"row {i}" for i in batch)
                                    if batch else "decoding: none"), (lines, batch)
                if ended:
                    assert all(f"row {i}" in lines[3] for i in ended), (lines, ended)
                else:
                    assert lines[3] == "ended: none", lines
                seen.append(n)
                if batch and ended:
                    break
                page.keyboard.press("ArrowLeft")
                for _ in range(20):
                    page.wait_for_timeout(100)
                    d = page.evaluate(DETAIL_JS)
                    if d["steps"] and d["steps"][0] != lines[0]:
                        break
            print(f"step inspector walked {seen}: {lines}")
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "step.png"))
            _to_docs(tmp_path / "step.png", "step-inspector.png")
            assert d["kind"] == "step" and len(set(seen)) == len(seen) and seen == sorted(seen, reverse=True)
            assert batch and ended, seen
            page.keyboard.press("ArrowLeft")  # one step back, by keyboard
            for _ in range(20):
                page.wait_for_timeout(100)
                prev = page.evaluate(DETAIL_JS)["steps"]
                if prev and prev[0] != lines[0]:
                    break
            m = re.match(r"step \d+ of this run \(engine step (\d+)\)", prev[0])
            assert m and int(m.group(1)) < seen[-1], prev
            batch = exp["steps"][m.group(1)][0]
            assert prev[1] == ("decoding: " + ", ".join(f"row {i}" for i in batch)
                               if batch else "decoding: none"), (prev, batch)
            page.keyboard.press("Escape")
            page.wait_for_timeout(200)
            assert page.evaluate(DETAIL_JS)["hidden"]
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "detail.png"))

            # save with widget state, shut everything down, reopen without a kernel
            page.locator(".jp-Notebook").first.click()
            page.keyboard.press("Control+s")
            for _ in range(40):
                page.wait_for_timeout(250)
                meta = _saved(root / "e2e.ipynb").get("metadata", {})
                if "details" in json.dumps(meta.get("widgets", {})):
                    break
            for sess in _sessions(base, token):
                req = urllib.request.Request(
                    f"{base}/api/sessions/{sess['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
            _open(page, base, token, "lab", left)
            prompts = page.locator(".mlxnb-widget .mlxnb-prompt")
            for _ in range(60):
                if prompts.count() == 4:
                    break
                page.wait_for_timeout(200)
            prompts.nth(0).click()
            page.wait_for_timeout(500)
            d = page.evaluate(DETAIL_JS)
            print(f"reopened row 0: {len(d['toks'])} tokens, trace {d['trace']}")
            assert d["kind"] == "row" and len(d["toks"]) == exp["ntok0"], d["note"]
            assert abs(float(d["toks"][0][1]) - exp["p0"]) < 1e-4
            prompts.nth(2).click()
            page.wait_for_timeout(300)
            d = page.evaluate(DETAIL_JS)
            wf = {phase: text for phase, _, text in d["wf"]}
            assert "(batch full)" in wf["queued"], wf
    assert not errors, "\n".join(errors)
