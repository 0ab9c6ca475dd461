"""Put OpenBLAS under MLX on Linux CPU.

The `mlx[cpu]` Linux wheel links a bundled reference (netlib) BLAS, which is 8-35x
slower than OpenBLAS for the f32 matmuls that dominate CPU inference. MLX's library
resolves `cblas_sgemm` & co. through the dynamic linker, and the global symbol scope
is searched before a library's own dependencies. So if OpenBLAS is loaded with
RTLD_GLOBAL *before* `mlx.core` is imported, its symbols win; measured on a 2-core
x86_64 box: 1024^3 f32 matmul 4.9 GFLOP/s -> 176 GFLOP/s (the LD_PRELOAD route gives
the same). Loading it after `import mlx.core` has no effect (the bindings are already
made), which is why this must run first and why `blas_env()` exists for
subprocesses (kernels) that may import mlx before mlxnb.

Nothing here touches macOS (MLX uses Accelerate there) or GPU backends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# Debian/Ubuntu (multiarch), Fedora/RHEL (libopenblasp = pthread build), Arch, Alpine.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

# Why the last preload_openblas() did or did not load OpenBLAS (for diagnostics).
status = "not attempted"
_loaded: str | None = None


def _disabled() -> bool:
    return os.environ.get("MLXNB_OPENBLAS", "").lower() in ("0", "off", "no", "false")


def openblas_path() -> str | None:
    """Path of a system OpenBLAS usable in front of MLX, or None.

    `$MLXNB_OPENBLAS` may name a library explicitly ("0"/"off" disables the whole
    mechanism). pip-installed OpenBLAS builds (numpy's, scipy-openblas) are of no use:
    they prefix or suffix their symbol names, so they cannot stand in for cblas_*.
    """
    if not sys.platform.startswith("linux") or _disabled():
        return None
    explicit = os.environ.get("MLXNB_OPENBLAS")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for p in _CANDIDATES:
        if os.path.exists(p):
            return p
    name = ctypes.util.find_library("openblas")  # e.g. "libopenblas.so.0"
    return name or None


def _usable(lib) -> bool:
    """True if `lib` exports LP64 cblas_sgemm (an ILP64 build would corrupt args)."""
    if not hasattr(lib, "cblas_sgemm"):
        return False
    try:
        cfg = lib.openblas_get_config
        cfg.restype = ctypes.c_char_p
        return b"USE64BITINT" not in (cfg() or b"")
    except AttributeError:
        return True


def mlx_imported() -> bool:
    return "mlx.core" in sys.modules


def preload_openblas() -> str | None:
    """Load OpenBLAS RTLD_GLOBAL so that MLX's BLAS calls resolve to it.

    Must run before the first `import mlx.core` anywhere in the process. Returns the
    library path when OpenBLAS is (now or already) in front, else None: on non-Linux,
    when no OpenBLAS is installed, when disabled via MLXNB_OPENBLAS=0, or when mlx was
    imported first (too late; see `status`). Idempotent.
    """
    global status, _loaded
    if _loaded:
        return _loaded
    path = openblas_path()
    if path is None:
        status = ("disabled by MLXNB_OPENBLAS" if _disabled() else
                  "not Linux" if not sys.platform.startswith("linux") else
                  "no system OpenBLAS found (apt install libopenblas0-pthread)")
        return None
    if _preloaded_via_env(path):
        status = f"OpenBLAS via LD_PRELOAD ({path})"
        _loaded = path
        return path
    if mlx_imported():
        status = ("mlx.core was imported before mlxnb: MLX keeps its bundled "
                  "reference BLAS (slow); import mlxnb first or set LD_PRELOAD="
                  f"{path}")
        return None
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        status = f"could not load {path}: {e}"
        return None
    if not _usable(lib):
        status = f"{path} is not an LP64 CBLAS; ignored"
        return None
    status = f"OpenBLAS preloaded ({path})"
    _loaded = path
    return path


def _preloaded_via_env(path: str) -> bool:
    pre = os.environ.get("LD_PRELOAD", "")
    base = os.path.basename(path)
    return any(os.path.basename(p) == base for p in pre.replace(":", " ").split())


def blas_env(env: dict | None = None) -> dict:
    """Env vars that make a child process (e.g. a Jupyter kernel) use OpenBLAS even if
    it imports mlx before mlxnb: LD_PRELOAD with the library prepended. Returns only
    the variables to set ({} when not applicable). `env` defaults to os.environ."""
    env = os.environ if env is None else env
    path = openblas_path()
    if path is None:
        return {}
    pre = env.get("LD_PRELOAD", "")
    if os.path.basename(path) in pre:
        return {}
    return {"LD_PRELOAD": f"{path} {pre}".strip() if pre else path}
