"""The model's own first kernels, compiled in parallel before the load probes run.

On a fresh CUDA machine (MLX's on-disk kernel cache empty) an engine's start was
mostly NVRTC compiling a handful of kernels one after another, 4-10 s each on an
H200 host: the embedding lookup and the caches' row filters (a gather per data and
index type), the row filter of the token vector, the rolls of rows' KV positions
(a prefill group's and a verification's: roll.py's gather of [D] vectors, and
mlx-lm's `dynamic_roll` for sliding-window caches), the fused SwiGLU of the MLP
(bench/results/cold-start-2026-11-29-h200.md). None of their names depends on the
model's sizes, only on its dtype, so tiny inputs of that dtype compile the same
kernels.

This package's own CUDA kernels (the decode attention of kv_kernels.py and
kv_onekey.py, wide_kernel.py's verification attention, rows_gemv.py's kernel) cannot
be compiled here: MLX keeps a kernel made with `mx.fast.cuda_kernel` in the process
that compiled it and never on disk (mlx/backend/cuda/custom_kernel.cpp passes
`use_disk_cache=false`), so every process compiles them anew with NVRTC, at the load
check that first runs them (on a fresh H200 host 3-4 s for two decode attention
kernels, 11-12 s for the verification attention's eight:
bench/results/first-token-2026-12-03-h200.md).

Beside these pieces, the compiled-function calls that calls_ahead.py's survey of the
load's forwards found (a hybrid model's recurrent layers: mlx-lm's gated delta rule,
MLX's activations) run in processes of their own, JSON in place of a piece's name.

`start` runs one process per piece (each importing mlx alone: about a second) into
a private folder; `wait` moves what they wrote into MLX's folder, where the engine's
probes then find every kernel compiled: the wall time is the slowest piece instead of
the sum. Like precompile.py's sampling kernels, only where MLX keeps compiled kernels
on disk (CUDA); a piece that fails or is late costs nothing but the wait, since the
engine compiles whatever it does not find.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ..._log import log, swallowed
from ...models.kernel_cache import ptx_dir
from . import calls_ahead
from .compilers import move_kernels, piece_folder, spawn, wanted

# one kernel each: a process compiles its kernels one after another, so the wait is
# the slowest piece's (and "state_rows" where the model keeps recurrent states)
PIECES = ("gather", "rows", "counters", "roll", "dynamic_roll", "swiglu")
_DONE = "mlxnb-model-kernels-{dtype}-{piece}.done"


def model_dtype(model) -> Optional[str]:
    """The name of the model's first floating-point parameter's dtype ('bfloat16')."""
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).rsplit(".", 1)[-1]
    return None


class ModelKernels:
    """Compiles the pieces above for one dtype; `wait` before the model's first use."""

    def __init__(self, dtype: Optional[str], forwards: Sequence[Callable] = ()):
        """`forwards`: the load's forwards, as builders (loadchecks.load_forwards), whose
        compiled calls are compiled too."""
        self.dtype = dtype
        self.forwards = list(forwards)
        self.wanted = list(PIECES)
        self.pieces: List[str] = []
        self.procs: List[subprocess.Popen] = []
        self.private: Optional[Path] = None
        self.started_at = 0.0

    @classmethod
    def for_model(cls, model, tokenizer) -> "ModelKernels":
        """The pieces for the model's dtype and the calls of the load's forwards."""
        from mlx_lm.models.cache import ArraysCache  # (imports mlx-lm: not in the compilers)

        from .caches import leaves, make_row_cache
        from .loadchecks import load_forwards, probe_ids

        ahead = cls(model_dtype(model), load_forwards(
            model, lambda: make_row_cache(model), probe_ids(tokenizer)))
        if any(type(c) is ArraysCache for c in leaves(make_row_cache(model))):
            ahead.wanted.append("state_rows")
        return ahead

    def _done(self, piece: str) -> List[Path]:
        """The files that mark `piece` compiled on this machine."""
        if calls_ahead.is_piece(piece):
            return [ptx_dir() / n for n in calls_ahead.done_names(piece)]
        return [ptx_dir() / _DONE.format(dtype=self.dtype, piece=piece)]

    def missing(self) -> List[str]:
        """The wanted pieces not compiled before for this dtype, where this backend
        keeps compiled kernels (else none); the survey's calls join them here."""
        if self.dtype is None or not wanted():
            return []
        if self.forwards:
            self.wanted += calls_ahead.pieces(calls_ahead.survey(self.forwards),
                                              lambda name: (ptx_dir() / name).exists())
            self.forwards = []
        return [p for p in self.wanted if not all(f.exists() for f in self._done(p))]

    @property
    def finished(self) -> bool:
        """Have the started compilers all exited? (`wait` then returns at once.)"""
        return all(p.poll() is not None for p in self.procs)

    def start(self) -> bool:
        """Start the compilers of the pieces not compiled before for this dtype,
        unless this backend keeps no kernels; True if any started."""
        pieces = self.missing()
        if not pieces:
            return False
        self.private, self.procs = spawn(__name__, pieces, self.dtype, "model")
        if not self.procs:
            return False
        self.pieces = pieces
        self.started_at = time.perf_counter()
        return True

    def wait(self, timeout: float = 60.0) -> float:
        """Wait (at most `timeout` s) for the compilers and move their kernels into
        MLX's folder; returns the seconds waited. Late ones are stopped."""
        if not self.procs:
            return 0.0
        t0 = time.perf_counter()
        done = []
        for piece, p in zip(self.pieces, self.procs):
            try:
                p.wait(max(0.0, timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode == 0:
                done.append(piece)
            else:
                err = (p.stderr.read() or b"").decode(errors="replace").strip().splitlines()
                log.info("model-kernel compiler %s exited %s: %s", piece[:80], p.returncode,
                         err[-1] if err else "")
        try:
            moved = sum(move_kernels(piece_folder(self.private, i), ptx_dir())
                        for i in range(len(self.procs)))
            for piece in done:
                for f in self._done(piece):
                    f.touch()
            log.info("model kernels compiled in %.1f s (%d files)",
                     time.perf_counter() - self.started_at, moved)
        except OSError:
            swallowed("moving the compiled model kernels")
        self.close()
        return time.perf_counter() - t0

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
        self.procs, self.pieces = [], []
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None


def _activations():
    """mlx-lm's activations module, loaded from its file: importing it through the
    package would import mlx_lm and transformers (seconds in every compiler)."""
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    path = Path(spec.submodule_search_locations[0]) / "models" / "activations.py"
    mod_spec = importlib.util.spec_from_file_location("_mlxnb_activations", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _compile(piece: str, dtype: str) -> None:
    """Run `piece` on small arrays of `dtype`, as the engine's first steps do."""
    from .tokens import ids

    dt = getattr(mx, dtype)
    if calls_ahead.is_piece(piece):  # recorded calls of a compiled function
        calls_ahead.run_piece(piece)
        return
    if piece == "state_rows":  # a recurrent layer's float32 states filtered by row
        out = [mx.zeros((3, 2, 5, 4), mx.float32)[ids([2, 0])]]
    elif piece == "gather":  # the embedding lookup [B, L] and a cache's row filter
        w = mx.zeros((16, 8), dt)
        out = [w[ids([[1, 2, 3]])], mx.zeros((3, 2, 5, 4), dt)[ids([2, 0])]]
    elif piece == "rows":  # the next-token vector filtered by row
        out = [ids([5, 6, 7])[ids([2, 0])]]
    elif piece == "counters":  # the sampler's counters, and mlx-lm's batch caches'
        # int32 offsets and paddings, filtered by row
        out = [mx.array([5, 6, 7])[ids([2, 0])]]
    elif piece == "roll":  # finalize() of a right-padded prefill group, rollbacks:
        # roll.py's gather of [D] vectors by a flat int32 index
        from .roll import RowRoll

        out = [RowRoll(mx.array([0, 3]))(mx.zeros((2, 2, 8, 4), dt), 6)]
    elif piece == "dynamic_roll":  # mlx-lm's dynamic_roll (its sliding-window
        # caches): take_along_axis with int32 positions [B, 1, S, 1] (importing
        # mlx_lm.models.cache would import mlx_lm whole)
        x, shifts = mx.zeros((2, 2, 8, 4), dt), mx.array([0, 3])[:, None]
        out = [mx.take_along_axis(x, (mx.arange(8)[:, None] - shifts[..., None, None]) % 8,
                                  axis=2)]
    else:  # swiglu over the two halves of a fused gate/up product (fuse.py)
        swiglu = _activations().swiglu
        out = []
        for shape in ((1, 1, 16), (2, 5, 16)):
            y = mx.zeros(shape, dt)
            out.append(swiglu(y[..., :8], y[..., 8:]))
    mx.eval(out)


if __name__ == "__main__":
    _compile(sys.argv[1], sys.argv[2])
