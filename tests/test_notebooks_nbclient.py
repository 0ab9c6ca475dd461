"""The notebook surface in a real kernel, run headless.

A notebook is built here with nbformat and executed by nbclient (a real ipykernel,
`store_widget_state=True`) on a tiny random-weight model saved to a directory, so it
runs in seconds:

* two `%%generate` cells: the second cell's rows join the batch the first cell's rows
  are still decoding in (the engine's step records show a batch of 5);
* `await a; await b` finishes every row with a finish reason;
* the widget state nbclient saved (nb.metadata.widgets) shows every row done;
* while 32 rows decode, trivial cells still complete quickly (kernel responsiveness).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
TIMEOUT_S = 120  # per cell; a cell that hangs fails the test instead of CI


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny byte-vocab llama as an ordinary mlx-lm directory (`%mlxnb load DIR`)."""
    from mlxnb.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def kernel_env() -> dict:
    """The kernel must import this checkout's mlxnb even when it is not pip-installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet debugpy warning
    return env


def make_nb(*sources: str):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def client_for(nb, cwd) -> "nbclient.NotebookClient":
    return nbclient.NotebookClient(
        nb, timeout=TIMEOUT_S, kernel_name="python3", store_widget_state=True,
        resources={"metadata": {"path": str(cwd)}})


def stdout_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")


def tagged_json(cell, tag: str):
    """The JSON a cell printed on a line starting with `tag`."""
    for line in stdout_of(cell).splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise AssertionError(f"no {tag!r} line in the cell's output: {cell.outputs!r}")


def widget_states(nb) -> list:
    """The saved state of every mlxnb GenerationWidget model in the notebook."""
    saved = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return [m["state"] for m in saved.values()
            if isinstance(m.get("state"), dict) and "rows" in m["state"]
            and "header" in m["state"]]


def assert_no_errors(nb):
    for i, cell in enumerate(nb.cells):
        errs = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        assert not errs, f"cell {i} raised: {errs[0].ename}: {errs[0].evalue}"
        stderr = "".join(o.get("text", "") for o in cell.get("outputs", [])
                         if o.output_type == "stream" and o.name == "stderr")
        assert "Traceback" not in stderr, f"cell {i} stderr: {stderr}"


# Greedy rows of the tiny model run to max_tokens (it does not emit <eos> on these
# prompts), and 600 tokens take a few seconds: `a` is still decoding when `b` joins.
MAX_TOKENS = 600

SUMMARY = r"""
import json
from mlxnb.notebook.magics import get_engine
eng = get_engine()
def rec(run, r):
    return {"run": run, "finish": r.finish_reason, "ntok": r.ntok, "state": r.state,
            "t_submit": r.t_submit, "t_admit": r.t_admit, "t_done": r.t_done}
out = {"rows": [rec("a", r) for r in a.rows] + [rec("b", r) for r in b.rows],
       "results": [x.finish_reason for x in res_a + res_b],
       "steps": [[s.t, s.batch_size, s.prefill_tokens] for s in eng.steps],
       "widgets": [type(x.widget).__name__ for x in (a, b)]}
print("SUMMARY " + json.dumps(out))
"""


def test_rows_from_two_cells_share_one_batch(tiny_dir, tmp_path):
    nb = make_nb(
        "%load_ext mlxnb",
        f"%mlxnb load {tiny_dir}",
        f"%%generate --max-tokens {MAX_TOKENS} -o a\n"
        "Write a haiku about the sea.\nExplain KV caches to a ten-year-old.\n"
        "Name three prime numbers.",
        f"%%generate --max-tokens {MAX_TOKENS} -o b\nCount to ten.\nSay hello politely.",
        "res_a = await a\nres_b = await b",
        SUMMARY,
        "%mlxnb unload",
    )
    t0 = time.perf_counter()
    client_for(nb, tmp_path).execute(env=kernel_env())
    print(f"\nnotebook executed in {time.perf_counter() - t0:.1f} s")
    assert_no_errors(nb)
    s = tagged_json(nb.cells[5], "SUMMARY ")

    # Every row finished, with a finish reason (greedy tiny rows run to the limit).
    assert len(s["rows"]) == 5
    assert all(r["state"] == "done" for r in s["rows"]), s["rows"]
    assert all(r["finish"] in ("stop", "length") for r in s["rows"]), s["rows"]
    assert s["results"] == [r["finish"] for r in s["rows"]]
    assert all(r["ntok"] > 0 for r in s["rows"])
    assert s["widgets"] == ["GenerationWidget"] * 2

    # Continuous batching: `b` was submitted while `a` was decoding, and the batch
    # grew to all 5 rows before any row of `a` finished.
    a_rows = [r for r in s["rows"] if r["run"] == "a"]
    b_rows = [r for r in s["rows"] if r["run"] == "b"]
    a_first_done = min(r["t_done"] for r in a_rows)
    assert max(r["t_submit"] for r in b_rows) < a_first_done, "b came after a finished"
    assert max(r["t_admit"] for r in b_rows) < a_first_done, "b waited for a to finish"
    joint = [st for st in s["steps"] if st[1] == 5]
    assert joint, f"batch never reached 5: sizes {sorted({st[1] for st in s['steps']})}"
    assert joint[0][0] < a_first_done
    # ... and the batch was 3 (a alone) before that.
    assert any(st[1] == 3 and st[0] < joint[0][0] for st in s["steps"])
    print(f"steps: {len(s['steps'])}, at batch 5: {len(joint)}")

    # The saved widget state (what a reopened notebook renders) shows every row done.
    states = widget_states(nb)
    assert len(states) >= 2, f"widget state not saved: {list(nb.metadata.keys())}"
    saved_rows = [r for st in states for r in st["rows"]]
    assert len(saved_rows) == 5
    assert all(r["state"] == "done" and r["finish"] in ("stop", "length")
               for r in saved_rows), [(r["state"], r["finish"]) for r in saved_rows]
    assert sorted(r["ntok"] for r in saved_rows) == sorted(r["ntok"] for r in s["rows"])
    for st in states:
        assert st["header"]["live"] is False
        assert len(st["steps"]["s"]) > 0  # the charts have data in the saved state


RESPONSIVE_ROWS = 32
TRIVIAL_CELLS = 15


def test_kernel_stays_responsive_while_32_rows_decode(tiny_dir, tmp_path):
    """Round-trip time of a trivial cell (client sends execute_request -> gets the
    reply, as nbclient sees it) while 32 rows are decoding in the background."""
    trivial = "_e.running"  # a cell as cheap as `1 + 1`, that also proves rows run
    nb = make_nb(
        "%load_ext mlxnb",
        f"%mlxnb load {tiny_dir} --max-batch {RESPONSIVE_ROWS}",
        "import mlxnb.notebook.magics\n_e = mlxnb.notebook.magics.get_engine()\n"
        "prompts = [f'Row number {i}: tell a story.' for i in range(32)]",
        "%%generate --max-tokens 1500 -o big\n{prompts}",
        *([trivial] * TRIVIAL_CELLS),
        "big.cancel()\nawait big\nimport json\nprint('STATE ' + json.dumps(sorted({r.finish_reason for r in big})))",
        "%mlxnb unload",
    )
    c = client_for(nb, tmp_path)
    times = []
    with c.setup_kernel(env=kernel_env()):
        for i, cell in enumerate(nb.cells):
            t0 = time.perf_counter()
            c.execute_cell(cell, i, execution_count=i + 1)
            dt = time.perf_counter() - t0
            if cell.source == trivial:
                times.append(dt)
    assert_no_errors(nb)
    running = [int(cell.outputs[0]["data"]["text/plain"]) for cell in nb.cells
               if cell.source == trivial]
    assert set(tagged_json(nb.cells[-2], "STATE ")) <= {"cancelled", "length"}
    ms = sorted(1000 * t for t in times)
    med, worst = statistics.median(ms), ms[-1]
    print(f"\ntrivial cell round trip while {RESPONSIVE_ROWS} rows decode: median "
          f"{med:.1f} ms, max {worst:.1f} ms (n={len(ms)}; target < 50 ms); rows "
          f"running seen: {running}")
    # Rows were really decoding while we measured.
    assert all(n > 0 for n in running[:-1]), running
    # Loose: this 2-core CI machine is shared with other work; the design target
    # (< 50 ms) is what the printed median is compared against in reports.
    assert med < 250, ms

