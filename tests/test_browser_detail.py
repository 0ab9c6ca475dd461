"""The widget's teaching views in a real browser -- the row view (its life as a
waterfall, its tokens with their probabilities) and the step inspector -- in
JupyterLab 4 (light theme) and Notebook 7 (dark theme), headless Chromium driven by
Playwright:

(a) opened on a live run, by mouse and by keyboard, their numbers match the Python
    side: a token's probability, a phase's duration, a step's rows;
(b) the keyboard reaches and drives them: Enter on a prompt opens its row, arrow
    keys walk the token list and the step chart (in Notebook 7 too, where the
    notebook's command-mode shortcuts take arrow keys before the page sees them)
    and leave the notebook's active cell alone, Esc closes;
(c) every text in them has at least 4.5:1 contrast on what it is drawn over (the
    theme's background, a token's shading), and at 600 px nothing overflows;
(d) saved with widget state and reopened with no kernel: the rows and steps opened
    live show the same numbers.

Uses Debian's Chromium at /usr/bin/chromium (never `playwright install`); bounded in
time; the server is always killed.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from _jupyter import DARK_THEME, Deadline, jupyter_lab
from test_browser_e2e import needs_browser, NB7_OWN_ERROR, _open, _saved, _sessions, chromium_page
from test_browser_views import SAVE_WIDGET_STATE, _to_docs

pytestmark = pytest.mark.browser
BUDGET_S = 200.0

DETAIL_JS = """() => { const w = document.querySelector('.mlxnb-widget');
  if (!w) return null;
  const d = w.querySelector('.mlxnb-detail');
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  return {hidden: d.hidden, kind: d.dataset.kind || '', trace: d.dataset.trace || '',
    title: d.querySelector('.mlxnb-detail-title').textContent,
    wf: [...d.querySelectorAll('.mlxnb-wf-row')].map((r) => [r.dataset.phase,
      r.querySelector('.mlxnb-wf-label').textContent, r.querySelector('.mlxnb-wf-text').textContent]),
    toks: [...d.querySelectorAll('.mlxnb-tok')].map((t) => [t.textContent, t.dataset.p]),
    info: (d.querySelector('.mlxnb-tokinfo') || {}).textContent || '',
    steps: [...d.querySelectorAll('.mlxnb-step-lines li')].map((l) => l.textContent),
    note: [...d.querySelectorAll('.mlxnb-detail-note')].map((n) => n.textContent).join(' | '),
    states: [...w.querySelectorAll('.mlxnb-row')].map((r) => r.dataset.state),
    active: (document.activeElement && document.activeElement.className) || '',
    activeCell: cells.findIndex((c) => c.classList.contains('jp-mod-active'))};
}"""

# WCAG contrast of every text in the detail panel over what it is drawn on: the
# backgrounds up the tree composited (a token's shading is translucent), and the
# text colour over that (themes write secondary text as translucent black or white).
CONTRAST_JS = """() => {
  const rgba = (s) => { const m = (s.match(/[\\d.]+/g) || []).map(Number);
    return m.length < 3 ? null : [m[0], m[1], m[2], m.length > 3 ? m[3] : 1]; };
  const over = (top, under) => top.slice(0, 3).map((c, i) => c * top[3] + under[i] * (1 - top[3]));
  const back = (e) => { const layers = [];
    for (; e; e = e.parentElement) { const c = rgba(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; } }
    return layers.reverse().reduce((acc, c) => over(c, acc), [255, 255, 255]); };
  const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  const lum = ([r, g, b]) => 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
  const d = document.querySelector('.mlxnb-widget .mlxnb-detail');
  const out = [];
  for (const e of [d, ...d.querySelectorAll('*')]) {
    const own = [...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || e.offsetParent === null) continue;
    const bg = back(e), fg = over(rgba(getComputedStyle(e).color), bg);
    const a = lum(fg), b = lum(bg);
    out.push([e.className || e.tagName, +((Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)).toFixed(2)]);
  }
  return {theme: document.querySelector('.mlxnb-widget').dataset.theme, texts: out};
}"""

CHART_STEPS_JS = """() => { const c = document.querySelector('.mlxnb-widget .mlxnb-chart-step');
  return c && c._hit ? c._hit.steps.slice(-6) : null; }"""

FIT_JS = """() => { const w = document.querySelector('.mlxnb-widget');
  const d = w.querySelector('.mlxnb-detail');
  const over = [d, ...d.querySelectorAll('.mlxnb-tokens, .mlxnb-wf, .mlxnb-step-lines, .mlxnb-tokinfo')]
    .filter((e) => e.scrollWidth > e.clientWidth + 1).map((e) => e.className);
  return {width: w.getBoundingClientRect().width, detail: d.getBoundingClientRect().width, over,
    tracks: [...d.querySelectorAll('.mlxnb-wf-track')].map((t) => t.getBoundingClientRect().width)};
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
        "           'p': [[math.exp(l['logprob']) for l in x.logprobs] for x in r.rows],\n"
        "           'ntoks': [x.ntok for x in r.rows],\n"
        "           'why2': r.rows[2].trace[0]['why'],\n"
        "           'phases2': {p['phase']: p.get('s') for p in r.rows[2].trace},\n"
        "           'decode2': [p for p in r.rows[2].trace if p['phase'] == 'decode'][0]['tokens'],\n"
        "           'step0': r.widget.header['step0'],\n"
        "           'steps': {s.step: [list(s.batch_ids), list(s.ended), s.batch_size]\n"
        "                     for s in eng.steps}},\n"
        "          open('expected.json', 'w'))",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb, nbformat


def _seconds(text: str) -> float:
    """A duration as the waterfall writes it ("12.3 ms", "1.25 s") in seconds."""
    m = re.match(r"([\d.]+) (ms|s)\b", text)
    assert m, text
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def _same_duration(shown: str, s: float) -> bool:
    """`shown` is `s` as written: 3 significant digits under a second, else 2 decimals."""
    return abs(_seconds(shown) - s) <= (0.0051 if s >= 1 else 0.0051 * s + 1e-6)


def _poll(page, until, left, what, tries=60, every=150):
    d = None
    for _ in range(tries):
        assert left() > 5, f"out of time waiting for {what}: {d}"
        d = page.evaluate(DETAIL_JS)
        if d is not None and until(d):
            return d
        page.wait_for_timeout(every)
    raise AssertionError(f"never {what}: {d}")


def _step_lines_match(lines, exp):
    """The inspector's lines against the engine's record of that step; its number."""
    m = re.match(r"step (\d+) of this run \(engine step (\d+)\) · [\d.]+ m?s · batch (\d+) decoding",
                 lines[0])
    assert m, lines
    n = int(m.group(2))
    assert int(m.group(1)) == n - exp["step0"], lines
    batch, ended, size = exp["steps"][str(n)]
    assert int(m.group(3)) == size, (lines, size)
    assert lines[1] == ("decoding: " + ", ".join(f"row {i}" for i in batch)
                        if batch else "decoding: none"), (lines, batch)
    if ended:
        assert all(f"row {i}" in lines[3] for i in ended), (lines, ended)
    else:
        assert lines[3] == "ended: none", lines
    return n, bool(batch), bool(ended)


def _check_row2_life(d, exp):
    wf = {phase: text for phase, _, text in d["wf"]}
    assert exp["why2"] == ["batch full"] and "(batch full)" in wf["queued"], wf
    assert _same_duration(wf["queued"], exp["phases2"]["queued"]), (wf, exp["phases2"])
    assert wf["decode"].startswith(f"{exp['decode2']} tokens · "), (wf, exp)
    assert _same_duration(wf["decode"].split(" · ")[1], exp["phases2"]["decode"]), (wf, exp)
    assert any(p == "prefill" for p, _, _ in d["wf"])


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_detail_views_live_and_from_a_saved_notebook(tmp_path, app):
    needs_browser(app)
    from mlxnb.models.tiny import save_tiny_model

    clock = Deadline(BUDGET_S)
    left = clock.left

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = _detail_notebook(save_tiny_model(tmp_path / "tiny"))
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    dark = app == "notebook"
    settings = {**SAVE_WIDGET_STATE, **(DARK_THEME if dark else {})}
    suffix = "-dark" if dark else ""
    with jupyter_lab(root, tmp_path / "jupyter", app=app, settings=settings) as (base, token):
        with chromium_page(tmp_path, height=1400) as page:
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            _open(page, base, token, app, left)
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all'], "
                         "li.lm-Menu-item[data-command='notebook:run-all-cells']").first.click()
            prompts = page.locator(".mlxnb-widget .mlxnb-prompt")
            d = _poll(page, lambda d: prompts.count() == 4 and "decode" in d["states"], left,
                      "a decoding row", tries=600, every=50)
            # (a) open a row while it decodes, by keyboard: its life and tokens grow live
            opened = d["states"].index("decode")
            prompts.nth(opened).focus()
            page.keyboard.press("Enter")
            d = _poll(page, lambda d: d["toks"], left, "the live row's tokens")
            print(f"\n[{app}] live row view: {d['title']} {d['wf']} {len(d['toks'])} tokens")
            assert not d["hidden"] and d["kind"] == "row" and d["trace"] == "kernel", d
            assert all(p is not None for _, p in d["toks"]), d["toks"][:3]
            # the list is kept as the row's news comes: its new tokens are appended
            page.evaluate("() => { document.querySelector('.mlxnb-tokens').dataset.probe = '1'; }")
            while not (root / "expected.json").exists():
                assert left() > 90, "the run never finished"
                page.wait_for_timeout(200)
            page.wait_for_timeout(500)
            exp = json.loads((root / "expected.json").read_text())
            print(f"[{app}] python side: ntoks {exp['ntoks']} row 2 {exp['phases2']}")
            # the view opened live kept up: all the row's tokens, in order, each with
            # the probability the sampler gave it; its life ends with the finish
            d = _poll(page, lambda d: len(d["toks"]) == exp["ntoks"][opened]
                      and d["wf"][-1][0] == "finish", left, "the opened row's last tokens")
            ps = [float(p) for _, p in d["toks"]]
            assert max(abs(a - b) for a, b in zip(ps, exp["p"][opened])) < 1e-4
            assert page.evaluate("() => document.querySelector('.mlxnb-tokens').dataset.probe") == "1"

            # row 0 by mouse: token 0's probability as the sampler gave it, in its line
            prompts.nth(0).click()
            d = _poll(page, lambda d: len(d["toks"]) == exp["ntoks"][0], left, "row 0's tokens")
            assert abs(float(d["toks"][0][1]) - exp["p0"]) < 1e-4, (d["toks"][0], exp["p0"])
            page.locator(".mlxnb-tok").first.hover()
            info = page.evaluate(DETAIL_JS)["info"]
            m = re.search(r"p = ([\d.]+)%", info)
            if "p = <0.1%" in info:
                assert exp["p0"] < 0.001, (info, exp["p0"])
            else:
                assert m and abs(float(m.group(1)) - 100 * exp["p0"]) <= 0.051, (info, exp["p0"])
            assert info.startswith("token 1:") and "temperature 0.8" in info, info
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "tokens.png"))
            _to_docs(tmp_path / "tokens.png", f"token-view{suffix}.png")

            # (b) the token list by keyboard; the notebook's active cell stays put
            cell0 = page.evaluate(DETAIL_JS)["activeCell"]
            page.locator(".mlxnb-tokens").first.focus()
            walk = []
            for key, want in [("ArrowRight", 2), ("ArrowRight", 3), ("ArrowDown", 4),
                              ("ArrowLeft", 3), ("ArrowUp", 2), ("End", exp["ntoks"][0]),
                              ("Home", 1)]:
                page.keyboard.press(key)
                d = page.evaluate(DETAIL_JS)
                walk.append((key, d["info"][:12], d["activeCell"], d["active"]))
                assert d["info"].startswith(f"token {want}:"), walk
                assert d["activeCell"] == cell0 and "mlxnb-tokens" in d["active"], walk
            # Tab order: the step chart, the panel's close button, its token list, the
            # rows' prompts
            order = []
            for key in ["Shift+Tab", "Shift+Tab", "Tab", "Tab", "Tab"]:
                page.keyboard.press(key)
                order.append(page.evaluate(DETAIL_JS)["active"].split(" ")[0])
            assert order == ["mlxnb-detail-close", "mlxnb-chart-step", "mlxnb-detail-close",
                             "mlxnb-tokens", "mlxnb-prompt"], order
            p_shown = float(page.locator(".mlxnb-tok").nth(0).get_attribute("data-p"))
            assert abs(p_shown - exp["p"][0][0]) < 1e-4

            # row 2 queued on the full batch (2 slots): its life says so, with the
            # phases' durations as the row's trace has them
            prompts.nth(2).click()
            d = _poll(page, lambda d: d["title"].startswith("row ") and d["trace"] == "kernel"
                      and "queued" in [w[0] for w in d["wf"]]
                      and "(batch full)" in dict((w[0], w[2]) for w in d["wf"])["queued"],
                      left, "row 2's life")
            print(f"[{app}] row 2: {d['wf']}")
            _check_row2_life(d, exp)
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "row-life.png"))
            _to_docs(tmp_path / "row-life.png", f"row-life{suffix}.png")
            # (c) contrast of the row view's texts (tokens on their shading included)
            row_contrast = page.evaluate(CONTRAST_JS)
            prompts.nth(0).click()
            prompts.nth(0).click()  # (the first click unpins row 2's highlight)
            _poll(page, lambda d: len(d["toks"]) == exp["ntoks"][0], left, "row 0 again")
            tok_contrast = page.evaluate(CONTRAST_JS)

            # the step inspector, by keyboard: Enter opens the last step, arrow keys
            # walk back (four steps at least, and to a step in which rows decoded and
            # one ended), each step's lines checked against the engine's record
            # the chart ends at the step the run's last rows ended in, once the widget's
            # last message is in (a busy host may take a moment)
            last = max(int(k) for k, (_, ended, _) in exp["steps"].items() if ended)
            for _ in range(100):
                drawn = page.evaluate(CHART_STEPS_JS)
                if drawn and drawn[-1] == last:
                    break
                assert left() > 30, f"the chart never drew step {last}: it ends {drawn}"
                page.wait_for_timeout(200)
            assert drawn and drawn[-1] == last, f"the chart never drew step {last}: it ends {drawn}"
            cell0 = page.evaluate(DETAIL_JS)["activeCell"]
            page.locator(".mlxnb-chart-step").first.focus()
            page.keyboard.press("Enter")
            d = _poll(page, lambda d: d["steps"], left, "the step inspector")
            seen, both = [], False
            for _ in range(60):
                lines = d["steps"]
                n, decoded, ended = _step_lines_match(lines, exp)
                seen.append(n)
                both = both or (decoded and ended)
                if both and len(seen) >= 4:
                    break
                page.keyboard.press("ArrowLeft")
                d = _poll(page, lambda d: d["steps"] and d["steps"][0] != lines[0], left,
                          "the previous step", tries=20, every=100)
                assert d["activeCell"] == cell0, d
            print(f"[{app}] step inspector walked {seen}: {lines}")
            assert d["kind"] == "step" and seen == sorted(set(seen), reverse=True), seen
            assert both and len(seen) >= 4, seen
            step_contrast = page.evaluate(CONTRAST_JS)
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "step.png"))
            _to_docs(tmp_path / "step.png", f"step-inspector{suffix}.png")
            page.keyboard.press("ArrowRight")  # and forward again
            d = _poll(page, lambda d: d["steps"] and d["steps"][0] != lines[0], left, "next step")
            assert _step_lines_match(d["steps"], exp)[0] == seen[-2], (d["steps"], seen)
            assert d["activeCell"] == cell0, d
            for name, c in [("row", row_contrast), ("tokens", tok_contrast),
                            ("step", step_contrast)]:
                low = [t for t in c["texts"] if t[1] < 4.5]
                print(f"[{app}] {name} view, {c['theme']}: {len(c['texts'])} texts, lowest "
                      f"{min(r for _, r in c['texts'])}")
                assert c["theme"] == ("dark" if dark else "light")
                assert c["texts"] and not low, (name, low)
            assert any("mlxnb-tok" in cls for cls, _ in tok_contrast["texts"])

            # (c) 600 px wide: the panel and its parts fit, the bars keep a width
            vw = 1280
            for _ in range(4):
                fit = page.evaluate(FIT_JS)
                if abs(fit["width"] - 600) <= 20:
                    break
                vw = round(vw + 600 - fit["width"])
                page.set_viewport_size({"width": vw, "height": 1400})
                page.wait_for_timeout(400)
            prompts.nth(2).click()
            d = _poll(page, lambda d: d["kind"] == "row" and d["wf"], left, "row 2 at 600 px")
            fit = page.evaluate(FIT_JS)
            print(f"[{app}] 600 px: {fit}")
            assert abs(fit["width"] - 600) <= 40 and not fit["over"], fit
            assert fit["tracks"] and min(fit["tracks"]) >= 40, fit
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "narrow.png"))
            page.set_viewport_size({"width": 1280, "height": 1400})
            page.keyboard.press("Escape")
            page.wait_for_timeout(200)
            assert page.evaluate(DETAIL_JS)["hidden"]

            # (d) save with widget state, shut everything down, reopen without a kernel
            for attempt in range(3):  # File > Save Notebook, until the state is on disk
                page.locator(".lm-MenuBar-item", has_text="File").first.click()
                page.locator("li.lm-Menu-item[data-command='docmanager:save']").first.click()
                for _ in range(40):
                    page.wait_for_timeout(250)
                    meta = json.dumps(_saved(root / "e2e.ipynb").get("metadata", {})
                                      .get("widgets", {}))
                    if "step_details" in meta and "batch_ids" in meta:
                        break
                else:
                    continue
                break
            assert "step_details" in meta and "batch_ids" in meta, meta[:300]
            for sess in _sessions(base, token):
                req = urllib.request.Request(
                    f"{base}/api/sessions/{sess['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
            _open(page, base, token, app, left)
            prompts = page.locator(".mlxnb-widget .mlxnb-prompt")
            # the saved widgets render from the notebook's state: seconds on a busy host
            while prompts.count() != 4:
                assert left() > 30, "the reopened notebook's widgets never rendered"
                page.wait_for_timeout(200)
            prompts.nth(0).click()
            d = _poll(page, lambda d: d["kind"] == "row" and d["toks"], left, "reopened row 0")
            print(f"[{app}] reopened row 0: {len(d['toks'])} tokens, trace {d['trace']}")
            assert len(d["toks"]) == exp["ntoks"][0], d["note"]
            assert abs(float(d["toks"][0][1]) - exp["p0"]) < 1e-4
            page.locator(".mlxnb-tok").first.hover()
            assert page.evaluate(DETAIL_JS)["info"].startswith("token 1:")
            prompts.nth(2).click()
            d = _poll(page, lambda d: d["title"].startswith("row 2") and d["wf"], left,
                      "reopened row 2")
            assert d["trace"] == "kernel", d
            _check_row2_life(d, exp)
            page.locator(".mlxnb-chart-step").first.focus()
            page.keyboard.press("Enter")  # the last step, inspected while the kernel ran
            d = _poll(page, lambda d: d["steps"], left, "the reopened step inspector")
            assert _step_lines_match(d["steps"], exp)[0] == seen[0], (d["steps"], seen)
            # the steps before it, inspected live too: the same lines; further back,
            # steps never inspected say so (the new kernel does not know the widget)
            shown = []
            for _ in range(len(seen)):
                first = d["steps"][:1]
                page.keyboard.press("ArrowLeft")
                d = _poll(page, lambda d: d["kind"] == "step" and d["steps"][:1] != first
                          and (d["steps"] or "not inspected" in d["note"]), left,
                          "a reopened earlier step", every=250)
                shown.append(_step_lines_match(d["steps"], exp)[0] if d["steps"] else None)
            print(f"[{app}] reopened steps: {shown} (inspected live: {seen})")
            assert shown[:len(seen) - 1] == seen[1:], (shown, seen)
            assert shown[-1] is None and "not inspected while the kernel ran" in d["note"], d
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "reopened.png"))
    errors = [e for e in errors if not (app == "notebook" and e == NB7_OWN_ERROR)]
    assert not errors, "\n".join(errors)


def test_the_contrast_probe_finds_faint_text(tmp_path):
    """CONTRAST_JS on a page made to fail: grey text on white, light text on a
    translucent shading, translucent text (a theme's secondary colour) -- each
    measured as drawn, so the check above can catch a view that breaks AA."""
    needs_browser(jupyter=False)
    html = """<body style="background:#fff"><div class="mlxnb-widget" data-theme="light">
      <div class="mlxnb-detail">
        <span class="ok" style="color:#333">fine</span>
        <span class="grey" style="color:#aaa">grey</span>
        <span class="shaded" style="color:#666;background:rgba(0,0,0,0.5)">shaded</span>
        <span class="faint" style="color:rgba(0,0,0,0.3)">faint</span>
        <span class="tint" style="color:#000;background:rgba(0,0,0,0.1)">tint</span>
        <span class="hidden" style="color:#fff;display:none">hidden</span>
      </div></div></body>"""
    with chromium_page(tmp_path, height=400) as page:
        page.set_content(html)
        got = dict(page.evaluate(CONTRAST_JS)["texts"])
    assert got["ok"] >= 4.5, got
    # #aaa on white is 2.32:1; #666 over 50 % black on white (#808080) 1.6:1;
    # 30 % black on white (#b3b3b3) 2.1:1
    assert abs(got["grey"] - 2.32) < 0.02 and got["shaded"] < 2 and got["faint"] < 2.2, got
    # black on a 10 % black tint over white is still ~16:1 (taken as opaque: 1:1)
    assert got["tint"] > 15, got
    assert "hidden" not in got
