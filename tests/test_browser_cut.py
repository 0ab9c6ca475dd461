"""In a real browser (JupyterLab 4, headless Chromium driven by Playwright): the widget
state a notebook saves holds a bounded share of each row's text, and a row whose text
it cut says so.

The kernel's text budget (mlxnb/notebook/textcap.py) is made small, so four rows of
the tiny model overflow it. Then:

(a) while the kernel runs, a view that streamed the rows shows all of their text, no
    cut mark, also after the final (cut) traits arrive;
(b) saved with widget state, the file's rows hold at most the budget, cut rows with
    "cut" (the characters left out);
(c) reopened without a kernel, each cut row shows "… [N more characters: see
    run.texts]" beside its text, collapsed and expanded, N as saved; whole rows show
    no mark.

Uses Debian's Chromium at /usr/bin/chromium (never `playwright install`); bounded in
time; the server is always killed.
"""

from __future__ import annotations

import urllib.request

import pytest

from _jupyter import Deadline, jupyter_lab
from test_browser_e2e import SAVE_WIDGET_STATE, _open, _saved, _sessions, chromium_page, needs_browser

pytestmark = pytest.mark.browser
BUDGET_S = 150.0
TEXT_BUDGET = 400  # the kernel's budget here: four 800-token rows of the tiny model overflow it

# Per row of the first widget: its state, text shown, cut mark and where they sit.
ROWS_JS = """() => {
  const w = document.querySelector('.mlxnb-widget');
  if (!w) return null;
  const box = (e) => { const b = e.getBoundingClientRect();
    return {l: b.left, r: b.right, t: b.top, b: b.bottom, w: b.width}; };
  return {seq: w.dataset.seq, live: w.dataset.live,
    rows: [...w.querySelectorAll('.mlxnb-row')].map((r) => {
      const c = r.querySelector('.mlxnb-cut'), t = r.querySelector('.mlxnb-text');
      return {id: +r.dataset.id, state: r.dataset.state, ntok: +(r.dataset.ntok || 0),
        dataCut: r.dataset.cut || '', text: r.querySelector('.mlxnb-text-inner').textContent,
        cut: c ? c.textContent : null, cutShown: !!c && getComputedStyle(c).display !== 'none',
        cutBox: c ? box(c) : null, textBox: box(t),
        innerBox: box(r.querySelector('.mlxnb-text-inner'))};
    })};
}"""


def _notebook(tiny):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        "%load_ext mlxnb",
        f"%mlxnb load {tiny} --max-batch 4",
        "import mlxnb.notebook.textcap as textcap\n"
        f"textcap.TEXT_BUDGET = {TEXT_BUDGET}  # small, so these rows overflow it\n"
        'words = ["alpha", "beta", "gamma", "delta"]',
        "%%generate --max-tokens 800 --raw -o cutrun\nSay {words}.",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb, nbformat


def _saved_rows(path):
    """The rows trait of the saved widget titled cutrun, or None."""
    meta = _saved(path).get("metadata", {}).get("widgets", {})
    state = meta.get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for m in state.values():
        s = m.get("state", {})
        if s.get("header", {}).get("title") == "cutrun" and s.get("rows"):
            return s["rows"]
    return None


def test_a_saved_widget_marks_the_rows_whose_text_it_cut(tmp_path):
    needs_browser()
    from mlxnb.models.tiny import save_tiny_model

    clock = Deadline(BUDGET_S)
    left = clock.left

    root = tmp_path / "root"
    root.mkdir()
    nb, nbformat = _notebook(save_tiny_model(tmp_path / "tiny"))
    nbformat.write(nb, root / "e2e.ipynb")
    errors: list = []
    with jupyter_lab(root, tmp_path / "jupyter", settings=SAVE_WIDGET_STATE) as (base, token):
        with chromium_page(tmp_path, height=1200) as page:
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            _open(page, base, token, "lab", left)
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").first.click()

            # (a) live: the view streams every row; the cut traits leave it whole
            first = None
            while True:
                assert left() > 60, f"the rows never finished: {first}"
                v = page.evaluate(ROWS_JS)
                if v and len(v["rows"]) == 4:
                    first = first or v
                    if all(r["state"] == "done" for r in v["rows"]):
                        break
                page.wait_for_timeout(100)
            streamed = all(r["state"] != "done" for r in first["rows"])
            page.wait_for_timeout(1500)  # the final traits (cut) reach the view
            v = page.evaluate(ROWS_JS)
            print(f"\nfirst look: {[(r['state'], r['ntok']) for r in first['rows']]}; "
                  f"at the end: {[(r['ntok'], len(r['text']), r['cut']) for r in v['rows']]}")
            if streamed:  # (a view made after a row finished holds it cut, rightly)
                assert all(r["cut"] == "" and r["dataCut"] == "" for r in v["rows"]), v["rows"]

            # (b) save with widget state: the file holds the budget, and the cut marks
            rows = None
            for _attempt in range(3):  # File > Save Notebook, until the state is on disk
                page.locator(".lm-MenuBar-item", has_text="File").first.click()
                page.locator("li.lm-Menu-item[data-command='docmanager:save']").first.click()
                for _ in range(40):
                    page.wait_for_timeout(250)
                    rows = _saved_rows(root / "e2e.ipynb")
                    if rows and all(r["state"] == "done" for r in rows):
                        break
                else:
                    continue
                break
            assert rows and len(rows) == 4, "the widget state was not saved"
            assert sum(len(r["text"]) for r in rows) <= TEXT_BUDGET
            cut = {r["id"]: r["cut"] for r in rows if r.get("cut")}
            print(f"saved: {[(len(r['text']), r.get('cut')) for r in rows]}")
            assert len(cut) >= 2, rows  # 800 random tokens each: well past a 100-char share

            # (c) reopened, no kernel: the saved widget shows the marks
            for sess in _sessions(base, token):
                req = urllib.request.Request(
                    f"{base}/api/sessions/{sess['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
            _open(page, base, token, "lab", left)
            while True:  # the saved widget renders from the notebook's state
                assert left() > 15, "the reopened notebook's widget never rendered"
                v = page.evaluate(ROWS_JS)
                if v and len(v["rows"]) == 4:
                    break
                page.wait_for_timeout(200)
            for r in v["rows"]:
                if r["id"] in cut:
                    n = cut[r["id"]]
                    assert r["cut"] == f"\u2026 [{n} more characters: see run.texts]", r
                    assert r["dataCut"] == str(n) and r["cutShown"], r
                    # in view on the row's one line, after its text
                    c, t = r["cutBox"], r["textBox"]
                    assert c["w"] > 50 and t["l"] <= c["l"] and c["r"] <= t["r"] + 1, r
                    assert c["l"] >= r["innerBox"]["r"] - 1, r
                else:
                    assert r["cut"] == "" and not r["dataCut"], r
            rid = next(iter(cut))
            page.locator(f".mlxnb-row[data-id='{rid}'] .mlxnb-text").first.click()
            page.wait_for_timeout(300)
            r = next(x for x in page.evaluate(ROWS_JS)["rows"] if x["id"] == rid)
            assert r["cut"].startswith(f"\u2026 [{cut[rid]} more characters") and r["cutShown"], r
            assert r["cutBox"]["w"] > 0 and r["cutBox"]["b"] >= r["innerBox"]["b"] - 20, r
            page.locator(".mlxnb-widget").first.screenshot(path=str(tmp_path / "cut.png"))
    assert not errors, "\n".join(errors)
    print(f"took {clock.spent():.1f} s")
