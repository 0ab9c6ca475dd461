"""Ship the widget's front end inside the package: js/ is where it is developed,
mlxnb/static/ is where an installed mlxnb finds it (see mlxnb/_frontend.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

FRONT_END = ("widget.js", "lib.js", "views.js", "charts.js", "widget.css")


class BuildWithFrontEnd(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "mlxnb" / "static"
        dest.mkdir(parents=True, exist_ok=True)
        for name in FRONT_END:
            shutil.copy2(Path(__file__).parent / "js" / name, dest / name)


setup(cmdclass={"build_py": BuildWithFrontEnd})
