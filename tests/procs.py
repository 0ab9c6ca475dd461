"""Running a module's `__main__` in a fresh interpreter, as the engine starts its
compiler processes, and seeing what it imported."""

import ast
import json
import subprocess
import sys


def imported_by_main(module: str, argv: list, roots: tuple) -> list:
    """The sorted names of loaded modules under `roots` after `python -m module *argv`
    ran in a fresh interpreter (which must exit 0)."""
    code = ("import runpy, sys\n"
            f"sys.argv = {json.dumps([module.rsplit('.', 1)[-1]] + list(argv))}\n"
            f"runpy.run_module({module!r}, run_name='__main__')\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {tuple(roots)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.split("\n")[-2])
