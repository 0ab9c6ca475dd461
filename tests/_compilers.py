"""Stand-in kernel compilers for the sampling precompile tests: the same contract as
worker/compilers.py's `spawn` (a private folder and one process per piece), with
processes that exit at once or wait until a gate file exists."""

import subprocess
import sys
from pathlib import Path

_WAIT = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)"


def gated_spawn(root: Path, gate: Path, waits, kernels: bool = False):
    """A `spawn` whose processes for pieces where `waits(piece)` wait for `gate`;
    with `kernels`, each piece leaves `<piece>.ptx` and `.txt` in its folder."""
    from mlxnb.core.worker.compilers import piece_folder

    def spawn(module, pieces, arg, what):
        private = root / f"private-{what}-{len(list(root.iterdir()))}"
        private.mkdir()
        procs = []
        for i, piece in enumerate(pieces):
            if kernels:
                folder = piece_folder(private, i)
                folder.mkdir()
                (folder / f"{piece}.ptx").write_text("ptx")
                (folder / f"{piece}.txt").write_text("names")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _WAIT if waits(piece) else "pass", str(gate)],
                stderr=subprocess.PIPE))
        return private, procs

    return spawn
