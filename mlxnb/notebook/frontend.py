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


def bundle() -> str:
    """widget.js with each `import ... from "./x.js";` replaced by x.js itself (once,
    its own relative imports dropped: they name modules inlined before it): anywidget
    loads `_esm` as one module (a blob), so relative imports cannot resolve."""
    done = set()

    def inline(m):
        name = m.group(1)
        if name in done:
            return ""
        done.add(name)
        return _IMPORT.sub("", asset(f"{name}.js").read_text(encoding="utf-8"))

    return _IMPORT.sub(inline, asset("widget.js").read_text(encoding="utf-8"))
