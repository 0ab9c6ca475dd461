"""A miniature mixed workload run once when an Engine starts.

The first use of each kernel in a process pays one-off setup: MLX JIT-compiles and
loads kernels, and on CUDA also creates library handles and cuDNN graphs. Measured
on an H200 in a fresh process, the first prefill took 6.9 s and the first decode
step of a padded batch 3.6 s
(bench/results/cold-start-2026-11-29-h200.md) -- inside the first cell a
user runs, as time to first token. llama.cpp warms up at load for the
same reason (its `--no-warmup` flag turns it off). Here two rows prefill as a group
and decode unpadded (one greedy, one sampled), a third joins (a left-padded batch:
the masked attention path) and rows leave the batch one by one: the paths of
`BatchExecutor.tick` that every workload takes. Then the executor forgets it all
except which shapes it has seen, and a warm 256-token prefill seeds the prefill
rate that sizes the first joiners' chunks.

Top-k, logprobs and repetition penalties are left to their first use: off by
default, and on a fresh CUDA machine (MLX's on-disk PTX cache empty) a warm-up that
included them and mlx-lm's compiled top-p and min-p took 86 s against 57 s without;
their kernels took 3-13 s each to compile (`python -m bench cold-start`,
bench/results/cold-start-2026-11-29-h200.md), and precompile.py compiles them in the
background. (The sampler's top-p and min-p are plain ops, which compile nothing.)
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..._log import swallowed
from ..messages import Admit
from . import tokens
from .batch import BatchExecutor
from ..rows import SamplingParams


def _ids(n: int, salt: int):
    return [2 + (7 * i + salt) % 50 for i in range(n)]  # any vocab of 64+ tokens


def warm_up(ex: BatchExecutor, max_ticks: int = 200, run=None) -> float:
    """Run the workload above on `ex`; returns the seconds taken. `run(fn, *args)`
    runs each piece on the executor's MLX thread (default: this thread), one tick per
    call, so ticks of other engines sharing that thread interleave with it.
    Failures are logged (mlxnb logger) and passed over: a model that cannot run a
    path fails real rows with a message of their own."""
    run = run or (lambda fn, *args: fn(*args))
    t0 = time.perf_counter()
    # equal lengths: an unpadded batch; the joiner's own prompt: no prefix reuse
    first = [Admit(-1, _ids(9, 1), SamplingParams(max_tokens=3)),
             Admit(-2, _ids(9, 2), SamplingParams(max_tokens=4, temperature=0.8, seed=1))]
    joiner = Admit(-3, _ids(40, 3), SamplingParams(max_tokens=2))
    try:
        run(ex.tick, first, [])
        for _ in range(max_ticks):
            admits = [joiner] if joiner is not None and ex.ids else []
            if admits:
                joiner = None
            report = run(ex.tick, admits, [])
            if not report.busy and joiner is None:
                break
    except Exception:
        swallowed("warm-up")
    # the buffers are small and get reused; mx.clear_cache would also hang in a
    # forked child (tests/test_prefill_policy.py)
    run(ex.close, False)
    # What the workload measured was cold and tiny: the first prefills (beside
    # running rows, and idle ones until a tick has measured its own) are sized by a
    # rate measured for the purpose instead.
    # On a GPU a 256-token forward is milliseconds once warm, and its first run pays
    # one-off setup for the shape (seconds on a cold device): it runs twice, each run
    # its own job (other engines' rows get a tick between the two). A CPU has no
    # per-shape setup and prefills at about the same rate at 64 tokens as at 256,
    # which it takes a second or two over: one 64-token run.
    n, runs = (256, 2) if mx.default_device() == mx.gpu else (64, 1)
    rate = max(run(prefill_rate, ex, n) for _ in range(runs))
    run(_restart, ex, rate)
    return time.perf_counter() - t0


def _restart(ex: BatchExecutor, rate: float) -> None:
    ex.policy.reset(rate)
    ex.nsteps = 0


def prefill_rate(ex: BatchExecutor, n: int = 256) -> float:
    """Prompt tokens/s of an n-token prefill (0.0 if it fails): the first estimate for
    the auto prefill budget, from a warm run (the best of two). Without it a fresh
    engine prefilled its first joiners in _AUTO_MIN chunks until ticks measured more;
    on an H200 each of those chunk shapes was new (CUDA sets up attention per shape),
    and the mixed bench's joiners waited 1.3 s in such a pass against 0.13 s once the
    rate was known."""
    ids = tokens.ids([_ids(n, 4)])
    try:
        cache = ex.make_cache()
        t = time.perf_counter()
        ex.model(ids, cache=cache)
        mx.eval([c.state for c in cache])  # as a prefill chunk: no logits
        took = time.perf_counter() - t
    except Exception:
        swallowed("warm-up prefill-rate probe")
        return 0.0
    return n / max(took, 1e-6)
