"""Stand-in kernel compilers for the background-compile tests: the same contract as
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


def gated_kernels_ahead(monkeypatch, root: Path, waits) -> Path:
    """kernels_ahead.py as on CUDA (compiled kernels kept under root/ptx), its
    compilers `gated_spawn`'s; returns the gate file."""
    from mlxnb.core.worker import kernels_ahead

    gate = root / "compiled"
    (root / "ptx").mkdir()
    monkeypatch.setattr(kernels_ahead, "spawn", gated_spawn(root, gate, waits))
    monkeypatch.setattr(kernels_ahead, "wanted", lambda: True)
    monkeypatch.setattr(kernels_ahead, "ptx_dir", lambda: root / "ptx")
    return gate
