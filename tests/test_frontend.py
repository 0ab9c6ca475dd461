"""The widget's front end as it ships: js/ modules, one ES module for anywidget."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mlxnb.notebook import frontend
from mlxnb.notebook.widget import GenerationWidget

JS = frontend.asset("widget.js").parent
IMPORT = re.compile(r'^import\s*\{[^}]*\}\s*from\s*"\./(\w+)\.js";?\s*$', re.M)
TOP = re.compile(r"^(?:export\s+)?(?:async\s+)?(?:function\*?|const|let|var|class)\s+([A-Za-z_$][\w$]*)", re.M)


def _graph():
    """Module name -> the modules it imports, for every module widget.js reaches."""
    graph, todo = {}, ["widget"]
    while todo:
        name = todo.pop()
        if name not in graph:
            graph[name] = IMPORT.findall((JS / f"{name}.js").read_text(encoding="utf-8"))
            todo.extend(graph[name])
    return graph


def test_bundle_inlines_every_module_once_before_its_users():
    src = frontend.bundle()
    assert GenerationWidget._esm == src
    assert not IMPORT.search(src) and "from \"./" not in src
    graph = _graph()
    assert {"lib", "views", "charts", "detail", "keys"} <= set(graph)
    at = {}
    for name in graph:  # each module's first top-level name marks where it sits
        first = TOP.search((JS / f"{name}.js").read_text(encoding="utf-8")).group(0)
        assert src.count(first) == 1, (name, first)
        at[name] = src.index(first)
    for name, deps in graph.items():
        for dep in deps:
            assert at[dep] < at[name], f"{dep}.js is inlined after {name}.js, which uses it"


def test_modules_share_one_scope_without_clashing_names_and_stay_small():
    seen = {}
    for name in _graph():
        text = (JS / f"{name}.js").read_text(encoding="utf-8")
        # the style rule: modules under ~400 lines
        assert len(text.splitlines()) < 450, f"{name}.js has {len(text.splitlines())} lines"
        for top in TOP.findall(text):
            assert top not in seen, f"{top} is defined in both {seen[top]}.js and {name}.js"
            seen[top] = name


@pytest.mark.skipif(shutil.which("node") is None, reason="node not found")
def test_the_bundle_loads_as_one_module(tmp_path):
    (tmp_path / "w.mjs").write_text(frontend.bundle(), encoding="utf-8")
    (tmp_path / "load.mjs").write_text(
        'const m = await import("./w.mjs"); console.log(typeof m.default.render);',
        encoding="utf-8")
    out = subprocess.run(["node", str(tmp_path / "load.mjs")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "function", out.stderr
