"""The widget's front end as anywidget takes it: the files, and one ES module."""

from __future__ import annotations

import re
from pathlib import Path

_IMPORT = re.compile(r'^import\s*\{[^}]*\}\s*from\s*"\./(\w+)\.js";?\s*$', re.M)


def asset(name: str) -> Path:
    # A wheel ships the front end in mlxnb/static; a source checkout has it in js/.
    package = Path(__file__).resolve().parents[1]
    for p in (package / "static" / name, package.parent / "js" / name):
        if p.exists():
            return p
    return package.parent / "js" / name


def bundle(entry: str = "widget") -> str:
    """`entry`.js with each `import ... from "./x.js";` replaced by x.js itself, its own
    imports inlined first (depth first, each module once): anywidget loads `_esm` as one
    module (a blob), so relative imports cannot resolve. The modules share one scope,
    so their top-level names must differ (tests/test_frontend.py checks)."""
    done = set()

    def inline(name: str) -> str:
        if name in done:
            return ""
        done.add(name)
        src = asset(f"{name}.js").read_text(encoding="utf-8")
        return _IMPORT.sub(lambda m: inline(m.group(1)), src)

    return inline(entry)
