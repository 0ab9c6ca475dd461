"""Ship the widget's front end inside the package: js/ is where it is developed,
mlxnb/static/ is where an installed mlxnb finds it (see mlxnb/notebook/frontend.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

JS = Path(__file__).parent / "js"
# every module of the widget (widget.js imports them) and its style sheet; not the tests
FRONT_END = sorted(p.name for p in JS.glob("*.js")) + ["widget.css"]


class BuildWithFrontEnd(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "mlxnb" / "static"
        dest.mkdir(parents=True, exist_ok=True)
        for name in FRONT_END:
            shutil.copy2(JS / name, dest / name)


setup(cmdclass={"build_py": BuildWithFrontEnd})
