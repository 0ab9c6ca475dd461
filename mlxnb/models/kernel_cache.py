"""Where MLX keeps the kernels it compiles, so a machine compiles each one once.

MLX's CUDA backend compiles fused kernels with NVRTC on first use and keeps them on
disk under `MLX_PTX_CACHE_DIR`, by default `<tmp>/mlx/<version>/ptx`: emptied by a
reboot on many hosts (tmpfs, tmp cleaners), after which every kernel compiles again
(about a minute of an engine's first start on an H200 host,
bench/results/cold-start-2026-11-29-h200.md). mlxnb points it into the user's cache,
beside the converted models, unless the user chose a folder. Metal and the CPU backend ignore it.

It must be set before MLX's first compile: MLX reads it once per process.

A compiled kernel is machine code for one GPU architecture, and MLX names it by its
source alone, so the folder is named by the GPUs' model (`ptx-nvidia-h200`, from the
NVIDIA driver's /proc files): a cache in a home folder that hosts with different GPUs
share would otherwise hand one GPU another's kernels, which fail to load. (A host
with GPUs of several models shares one folder among them, as MLX's default does;
this package writes no kernels of its own there, core/worker/kernel_files.py.)
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ENV = "MLX_PTX_CACHE_DIR"
GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU, each with `information`


def _mlx_version() -> str:
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def use_user_cache() -> None:
    """Point MLX's kernel cache at `<mlxnb cache>/mlx-<version>/ptx-<GPU model>` when
    neither the user nor an earlier import of mlx settled it. Idempotent; never raises."""
    if os.environ.get(ENV) or "mlx.core" in sys.modules:
        return
    from .gguf import cache_root

    # MLX creates the folder on its first compile (and does without a cache if it
    # cannot), so nothing is written here on backends that never use it.
    suffix = "".join(f"-{m}" for m in gpu_models())[:120]
    os.environ[ENV] = str(cache_root() / f"mlx-{_mlx_version()}" / ("ptx" + suffix))


def gpu_models() -> list:
    """The models of this host's NVIDIA GPUs, sorted, as names ('nvidia-h200'); []
    where the driver's files cannot be read."""
    models = set()
    try:
        for info in GPUS.glob("*/information"):
            for line in info.read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    models.add(re.sub(r"[^a-z0-9]+", "-", line[6:].lower()).strip("-"))
    except OSError:
        return []
    return sorted(m for m in models if m)


def ptx_dir() -> Path:
    """The folder MLX's CUDA backend reads compiled kernels from in this process."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    import mlx.core as mx

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"
