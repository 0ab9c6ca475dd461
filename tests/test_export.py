"""Saved and exported notebooks keep the finished rows: nbclient runs a notebook in a
real kernel, nbconvert exports it to HTML and Markdown, and every finished row's text
is in the export (results.py's output, updated by display id). A run still going
when the notebook ends is saved as unfinished, not as queued or running.
"""

from __future__ import annotations

import html
import json
import re

import pytest

from test_notebooks_nbclient import client_for, kernel_env, make_nb, tiny_dir  # noqa: F401

pytestmark = pytest.mark.integration

nbformat = pytest.importorskip("nbformat")
nbconvert = pytest.importorskip("nbconvert")
bs4 = pytest.importorskip("bs4")

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _norm(s: str) -> str:
    return " ".join(s.split())


def test_nbconvert_html_has_every_finished_rows_text(tiny_dir, tmp_path):  # noqa: F811
    nb = make_nb(
        "%load_ext mlxnb",
        f"%mlxnb load {tiny_dir} --max-batch 8",
        "%%generate --max-tokens 24 --raw --seed 3 --temp 0.9 -o a\n"
        "Write a haiku about <b>the sea</b> & \"sky\".\nName three primes.\nSay hi.",
        "%%generate --max-tokens 12 --raw -o b\nCount to ten.",
        "res = await a; await b\nimport json\nprint(json.dumps(a.texts + b.texts))",
        "%%generate --max-tokens 4000 --raw -o late\nnever awaited",
    )
    client_for(nb, tmp_path).execute(env=kernel_env())
    printed = [o for o in nb.cells[4].outputs if o.output_type == "stream"]
    texts = json.loads(printed[0].text)
    assert len(texts) == 4 and all(texts)

    # Each %%generate cell: the widget, then the results output that carries the rows.
    for i in (2, 3, 5):
        outs = nb.cells[i].outputs
        assert [WIDGET_MIME in o.get("data", {}) for o in outs] == [True, False], outs
    late = nb.cells[5].outputs[1].data
    assert "1 row unfinished as of" in late["text/plain"] and "done" not in \
        late["text/html"].split("mlxnb-results-row", 1)[1].split("</b>")[0]

    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)
    body, _ = nbconvert.HTMLExporter().from_filename(str(path))
    soup = bs4.BeautifulSoup(body, "html.parser")
    shown = [_norm(p.get_text()) for p in soup.select("pre.mlxnb-results-text")]
    for t in texts:
        assert html.escape(t) in body  # escaped once, whole
        assert _norm(t) in shown, (t, shown)
    assert not soup.select(".mlxnb-results script")
    states = [d["data-state"] for d in soup.select(".mlxnb-results-row")]
    assert states == ["done"] * 4 + ["unfinished"]
    assert re.search(r"3/3 rows done", body) and "unfinished as of" in body

    md, _ = nbconvert.MarkdownExporter().from_filename(str(path))
    for t in texts:
        assert html.escape(t) in md
