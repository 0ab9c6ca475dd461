"""The widget's front end as anywidget takes it: the files, and one ES module."""

from __future__ import annotations

import re
from pathlib import Path


def asset(name: str) -> Path:
    # A wheel ships the front end in mlxnb/static; a source checkout has it in js/.
    package = Path(__file__).resolve().parents[1]
    for p in (package / "static" / name, package.parent / "js" / name):
        if p.exists():
            return p
    return package.parent / "js" / name


def bundle() -> str:
    """widget.js with its `import ... from "./lib.js"` replaced by lib.js itself:
    anywidget loads `_esm` as one module (a blob), so relative imports cannot resolve."""
    lib = asset("lib.js").read_text(encoding="utf-8")
    src = asset("widget.js").read_text(encoding="utf-8")
    return re.sub(r'^import\s*\{[^}]*\}\s*from\s*"\./lib\.js";?\s*$', lambda m: lib,
                  src, count=1, flags=re.M)
