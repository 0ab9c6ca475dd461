"""Kernel compilers in helper processes: what precompile.py (sampling) and
kernels_ahead.py (the model's first kernels) share. Kept free of mlx-lm so that a
compiler process that needs only MLX starts in about a second.

MLX writes a kernel's `<name>.ptx` and then its `<name>.txt` (kernel names) and takes
the presence of the .ptx as "cached", so a move places the .txt first; a kernel
already in MLX's folder is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ..._log import swallowed
from ...models.kernel_cache import ptx_dir

__all__ = ["move_kernels", "piece_folder", "spawn", "wanted"]


def wanted() -> bool:
    """Whether this backend keeps compiled kernels on disk across processes."""
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False



def spawn(module: str, pieces, arg: str, what: str):
    """(private folder, processes): `python -m module piece arg` per piece, the i-th
    compiling into `piece_folder(private, i)` (its kernels can move into MLX's folder
    as soon as it exits); (None, []) if they cannot start."""
    cache = ptx_dir()
    private, procs = None, []
    try:
        cache.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=f"mlxnb-{what}-", dir=cache.parent))
        path = os.pathsep.join(p for p in sys.path if p)
        for i, piece in enumerate(pieces):
            env = dict(os.environ, MLX_PTX_CACHE_DIR=str(piece_folder(private, i)),
                       PYTHONPATH=path)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, piece, arg], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    except OSError:
        swallowed(f"starting the {what}-kernel compilers")
        for p in procs:
            p.kill()
            p.wait()
            p.stderr.close()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        return None, []
    return private, procs


def piece_folder(private: Path, i: int) -> Path:
    """Where the i-th process of `spawn` writes its kernels."""
    return private / str(i)


def move_kernels(src: Path, dst: Path) -> int:
    """Move kernels that `dst` lacks from `src` (see the module docstring for the
    order); returns the number of files moved. MLX names a kernel's files by its
    fused ops and splits names too long for one file name into nested folders, so
    the walk is recursive."""
    moved = 0
    if not src.is_dir():  # a compiler that wrote nothing
        return 0
    for ptx in sorted(src.rglob("*.ptx")):
        txt = ptx.with_suffix(".txt")
        target = dst / ptx.relative_to(src)
        if target.exists() or not txt.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for f in (txt, ptx):
            tmp = target.parent / f".{f.name}.{os.getpid()}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, target.parent / f.name)
            moved += 1
    return moved


