"""The package's rooms, checked by imports (mlxnb/core/__init__.py states the rule):
imports flow one way (notebook -> remote -> core -> models -> shared leaves), the
loop side of the core never imports MLX, and the worker never imports the loop."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mlxnb"
# lower rooms may not import higher ones
FLOORS = ["notebook", "remote", "core", "models"]
# the worker may use these loop-side leaves: plain records and the constraint compiler
WORKER_MAY_USE = {"mlxnb.core.messages", "mlxnb.core.states", "mlxnb.core.rows",
                  "mlxnb.core.constrain", "mlxnb.core.constraint_params",
                  "mlxnb.core.constraint_results", "mlxnb.core._trace"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    """Absolute names of the modules `path` imports (at any depth of its code)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            yield mod
            if not node.module:  # `from . import x`: x is a module
                yield from (f"{mod}.{a.name}" for a in node.names)


MODULES = sorted(PKG.rglob("*.py"))


def room(mod: str):
    parts = mod.split(".")
    return parts[1] if parts[0] == "mlxnb" and len(parts) >= 2 and parts[1] in FLOORS else None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_flow_down(path):
    mine = room(module_name(path))
    if mine is None:
        return
    above = FLOORS[:FLOORS.index(mine)]
    bad = [m for m in imports(path) if room(m or "") in above]
    assert not bad, f"{module_name(path)} imports a room above it: {bad}"


@pytest.mark.parametrize("path", sorted((PKG / "core").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_loop_side_never_imports_mlx(path):
    bad = [m for m in imports(path)
           if m and (m == "mlx" or m.startswith(("mlx.", "mlx_lm")))]
    assert not bad, f"{module_name(path)} runs on the event loop but imports {bad}"


@pytest.mark.parametrize("path", sorted((PKG / "core" / "worker").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_worker_never_imports_the_loop_side(path):
    bad = [m for m in imports(path) if m and m.startswith("mlxnb.core.")
           and not m.startswith("mlxnb.core.worker") and m not in WORKER_MAY_USE]
    assert not bad, f"{module_name(path)} (worker) imports loop-side {bad}"


def test_the_checks_see_imports():
    # the checks above pass vacuously if `imports` finds nothing
    found = set(imports(PKG / "core" / "worker" / "batch.py"))
    assert {"mlx.core", "mlxnb.core.messages", "mlxnb.core.worker.prefill"} <= found
    assert "mlxnb.core.worker.batch" in set(imports(PKG / "core" / "engine.py"))


def test_the_core_map_names_every_module():
    """mlxnb/core/__init__.py draws the core's rooms: every module of the core and
    its worker is on that map (a new one goes on it when it is added)."""
    import re

    text = (PKG / "core" / "__init__.py").read_text()
    doc = text[:text.index("Threads.")]
    named = set(re.findall(r"\b(\w+\.py)\b", doc))
    for folder in ("core", "core/worker"):
        for p in sorted((PKG / folder).glob("*.py")):
            if p.name != "__init__.py":
                assert p.name in named, f"{folder}/{p.name} is not on core/__init__.py's map"
