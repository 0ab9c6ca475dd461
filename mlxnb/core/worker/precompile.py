"""Sampling kernels compiled by helper processes while the engine serves rows.

On MLX's CUDA backend every fused kernel is compiled with NVRTC on its first use and
kept on disk (models/kernel_cache.py). On a fresh H200 host the fused Gumbel
sampling kernel took 36 s to compile, top-k's scatter 6-14 s, logprobs 19 s and the
repetition penalty 8 s, while the unfused ops of the same draw are prebuilt in MLX's
library (0.08 s on first use, ~0.6 ms more per step at B=8)
(bench/results/cold-start-2026-11-29-h200.md). Compiled inline, these paths held an
Engine's start (its warm-up samples) or a row's first token for that long. (Top-p
and min-p compile nothing: sampling.py's filters are plain ops.)

So when the sampling kernels are not yet on disk, `Precompiler` starts one process
per piece (they compile in parallel, one CPU core each) into private folders, and
the sampler draws with the unfused ops meanwhile (`sampling.use_fused(False)`). Each
process's files move into MLX's folder as soon as it exits: top-k's (mlx-lm's
compiled filter, which the unfused draw needs too) lands before the fused Gumbel
kernel, so a top-k row's first token need not wait for the slowest piece. Once all
have exited the sampler switches to the fused kernel, which MLX then loads from disk
in milliseconds. Both
draw the same tokens: the same ops on the same values (the fused kernel may contract
a multiply-add, which changes a noise value by an ulp at most: a token whose
perturbed logit ties the best one to that precision could differ).

Kernels that this process compiled meanwhile are kept (compilers.py moves them).

Only the CUDA backend keeps compiled kernels across processes; elsewhere nothing
starts and the fused path is used from the first step (the CPU compiles it in ~1 s).
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..._log import log, swallowed
from ...models.kernel_cache import ptx_dir
from .compilers import move_kernels as _move_kernels, piece_folder, spawn, wanted

# One process per piece: a piece's kernels compile serially within a process.
PIECES = ("gumbel", "top_k", "logprobs", "penalty")
_DONE = "mlxnb-sampling-{vocab}.done"


def _sampling():
    # imported when first used: a compiler process first trims what importing mlx-lm
    # costs (`_mlx_lm_without_its_package`)
    from . import sampling
    return sampling


class Precompiler:
    """Compiles the sampling kernels for a vocabulary of `vocab` in the background.

    Runs on the worker: `start()` once, then `poll()` between ticks (cheap: one
    waitpid per process until they have all exited)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.procs: List[subprocess.Popen] = []
        self.pieces: List[str] = []
        self.moved: List[bool] = []  # per process: its kernels are in MLX's folder
        self.private: Optional[Path] = None
        self.started_at = 0.0
        self.took: Optional[float] = None  # seconds, once done

    @property
    def pending(self) -> bool:
        return bool(self.procs)

    def start(self) -> bool:
        """Start compiling unless the kernels are on disk already (or this backend
        keeps none); True if started (or under way). Until `poll()` finishes,
        sampling is unfused."""
        if self.procs:
            return True
        cache = ptx_dir()
        if (self.vocab < 1 or not wanted()
                or (cache / _DONE.format(vocab=self.vocab)).exists()):
            return False
        self.pieces = list(PIECES)
        self.private, self.procs = spawn(__name__, self.pieces, str(self.vocab), "sampling")
        if not self.procs:
            return False
        self.moved = [False] * len(self.procs)
        self.started_at = time.perf_counter()
        _sampling().use_fused(False)
        return True

    def poll(self) -> None:
        if not self.procs:
            return
        for i, p in enumerate(self.procs):
            if not self.moved[i] and p.poll() is not None:
                self.moved[i] = True
                if p.returncode != 0:
                    err = (p.stderr.read() or b"").decode(errors="replace").strip()
                    log.info("sampling-kernel compiler %s exited %s: %s", self.pieces[i],
                             p.returncode, err.splitlines()[-1] if err else "")
                try:
                    _move_kernels(piece_folder(self.private, i), ptx_dir())
                    log.info("sampling kernels for %s on disk %.1f s after the start",
                             self.pieces[i], time.perf_counter() - self.started_at)
                except OSError:
                    swallowed("moving the compiled sampling kernels")
        if not all(self.moved):
            return
        failed = any(p.returncode != 0 for p in self.procs)
        for p in self.procs:
            p.stderr.close()
        self.procs = []
        self.took = time.perf_counter() - self.started_at
        if not failed:
            try:
                (ptx_dir() / _DONE.format(vocab=self.vocab)).touch()
            except OSError:
                swallowed("marking the sampling kernels compiled")
        log.info("sampling kernels compiled in %.1f s", self.took)
        self._cleanup()
        _sampling().use_fused(True)

    def wait(self, timeout: float) -> bool:
        """Poll until every piece has exited or `timeout` s pass; True if done."""
        end = time.monotonic() + timeout
        while self.procs and time.monotonic() < end:
            self.poll()
            time.sleep(0.05)
        return not self.procs

    def close(self) -> None:
        """Stop compiling (the process exits); the sampler is fused again."""
        for p in self.procs:
            p.kill()
            p.wait()
            p.stderr.close()
        self.procs = []
        self._cleanup()
        _sampling().use_fused(True)

    def _cleanup(self) -> None:
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None


_SHARED: Dict[int, Precompiler] = {}


def logit_width(model) -> int:
    """How many logits the model gives per position (0: cannot tell): its output
    layer's rows, else its token embedding's (a tied head), else what its config says,
    else any embedding's rows.
    Wrapped models (Qwen3.5, Mistral 3, Gemma 3n, ...) keep the size in a
    `text_config`, not on `model.args`."""
    mods = dict(model.named_modules())
    for end in ("lm_head", "embed_tokens"):
        for name, m in mods.items():
            w = getattr(m, "weight", None) if name.rsplit(".", 1)[-1] == end else None
            if isinstance(w, mx.array) and w.ndim == 2:
                return int(w.shape[0])
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        v = a.get("vocab_size") if isinstance(a, dict) else getattr(a, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    for m in mods.values():  # any other token embedding (Phixtral's `wte`)
        w = getattr(m, "weight", None)
        if "Embedding" in type(m).__name__ and isinstance(w, mx.array) and w.ndim == 2:
            return int(w.shape[0])
    return 0


def for_vocab(vocab: int) -> Precompiler:
    """The process's compile of the sampling kernels for `vocab`, shared by its
    engines and outliving them: it takes 30-45 s on a fresh host, and an engine
    closed sooner (a re-run cell, a benchmark's rounds) would otherwise stop it for
    the next engine to start over, compiling beside every engine, never done. The
    compilers stop when the process exits."""
    p = _SHARED.get(vocab)
    if p is None:
        p = _SHARED[vocab] = Precompiler(vocab)
    return p


@atexit.register
def _stop_all() -> None:
    for p in list(_SHARED.values()):
        p.close()


def _compile(piece: str, vocab: int) -> None:
    """Run `piece` once at two batch sizes on float32 logits, as the engine's
    sampled steps do. Only the "gumbel" piece draws with the fused kernel: the
    others exit as soon as their own kernels are on disk."""
    from mlx_lm.sample_utils import make_logits_processors

    sampling = _sampling()
    sampling.use_fused(piece == "gumbel")

    for B in (1, 8):
        logits = mx.random.normal((B, vocab)).astype(mx.float32)
        s = sampling.BatchSampler()
        filters = (20, 1.0, 0.0) if piece == "top_k" else (0, 1.0, 0.0)
        temp = 0.0 if piece == "logprobs" else 0.8
        s.extend([temp] * B, [filters] * B, list(range(B)), [0] * B)
        if piece == "penalty":
            proc = make_logits_processors(repetition_penalty=1.1)[0]
            out = proc(mx.zeros((1, 4), dtype=mx.uint32), logits[:1])
        elif piece == "logprobs":
            tok = s.sample(logits)
            out = s.logprobs(mx.arange(B), tok, 5)
        else:
            out = s.sample(logits)
        mx.eval(out)


def _mlx_lm_without_its_package() -> None:
    """In a compiler process: let `import mlx_lm.sample_utils` (all that sampling.py
    needs of mlx-lm, itself needing only MLX) run that one file. mlx-lm's package
    __init__ imports its generate and load paths and with them transformers: 1.5 s
    on a 2-core CPU, some 10 s on a fresh H200 host, in each of the processes at
    once, before any kernel compiles. The engine's own process imports the package."""
    import importlib.util
    import types

    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")  # (finds it without running it)
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType("mlx_lm")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["mlx_lm"] = pkg


if __name__ == "__main__":
    _mlx_lm_without_its_package()
    _compile(sys.argv[1], int(sys.argv[2]))
