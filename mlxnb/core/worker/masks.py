"""The batch's token masks: constrained rows' bitmasks filled each step while the
forward pass launches, and applied before the shared sampler.

The decode pipeline launches step N+1 before the host has read step N's tokens, but
a row's mask for step N+1 depends on the token it took at step N. So for a batch
that holds constrained rows, `_launch` builds step N+1's forward pass, reads step
N's tokens (done by then: that step was launched a whole step ago), and hands them
to fill threads, which feed each matcher its token, fill the next masks and copy
them to the device while the worker launches the forward's kernels.
`mx.async_eval` keeps the GIL while it launches (MLX 0.32, measured on its CPU
backend), but llguidance drops it while it works, so the matchers' work, not their
Python glue, is what overlaps the launch.
Then the worker masks the logits and samples. Masking sets disallowed logits to
-inf before the shared sampler, so greedy, temperature, top-k/p, min-p and the
per-row seeded noise work unchanged, and a seeded constrained row draws the same
tokens alone or in any batch.

Copies of one compiled matcher share its lexer behind one lock, so rows with one
schema would fill their masks one at a time whatever the thread count. So each row
joins a lane, and each lane has its own compile of every constraint; a step hands
whole lanes to as few fill threads as finish within the launch.

A row whose grammar is complete (nothing may follow) ends with `stop` at once, as if
it had sampled the end-of-sequence token; one cut by max_tokens ends with `length`.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .._trace import lap, pc
from ..constrain import Constraints
from ..constraint_params import kind_of, one_line
from ..messages import Ending
from ..states import Finish
from .inflight import InFlight
from .tokens import ids



# llguidance's error for a token its matcher refuses. The sampler never draws a
# token whose logit is -inf while any finite one is left (sampling.py), and the mask
# leaves only allowed tokens finite; so a refused draw means no allowed token kept a
# finite logit. In a row with logits processors they are what did that.
_REFUSED = "doesn't satisfy the grammar"
_NOTHING_LEFT = ("the logits processors left no token the constraint allows (each had "
                 "logit -inf or NaN after them), so the row drew a token it forbids; have "
                 "them keep some allowed token")


def default_fill_threads() -> int:
    """Fill threads (and lanes): a mask costs 0.01-0.3 ms of one core, a batch's
    masks several ms, and the worker needs a core of its own to launch the forward
    meanwhile: a quarter of the cores, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class MaskFiller:
    """The batch's masks, on the worker thread: which lane each constrained row
    takes, the fills of the step being launched, and the masking of its logits."""

    def __init__(self, constraints: Constraints, threads: Optional[int] = None):
        self.constraints = constraints
        self.threads = threads or default_fill_threads()
        self._next_lane = 0
        self._filler = None  # fill threads: the worker launches the forward meanwhile
        # this launch's masks: (stacking order, the fill tasks making them)
        self._pending: Optional[Tuple[Any, list, List[Future]]] = None
        # batch position -> how many tokens its constraint allowed, for the last
        # masks applied (the token view's "n tokens allowed here")
        self.allowed: Dict[int, int] = {}
        self._advanced = None  # the in-flight step whose tokens the matchers consumed
        self._pos_for = None  # batch rows list -> positions of its constrained rows
        self._pos: List[int] = []  # batch positions of the constrained rows
        self._ids: List[int] = []  # the batch's row ids
        self._idx = None
        self._lanes: List[list] = []  # per lane: [(constrained row k, matcher, batch position)]
        self._plans: Dict[int, tuple] = {}  # fill tasks -> their plan (_plan)
        self._tasks = self.threads  # fill tasks per step: as few as keep up (apply)
        self._shifts = None
        self.tracer = None  # _trace.py: set by BatchExecutor.trace

    def attach(self, r) -> None:
        """Give a row joining the batch its lane (rows take them in turn) and its
        matcher, a copy of that lane's compile; a free row keeps None."""
        if kind_of(r.params) is None:
            return
        r.lane, self._next_lane = self._next_lane, (self._next_lane + 1) % self.threads
        r.matcher = self.constraints.compile(r.params, r.lane)

    def _read_tokens(self, inflight: Optional[InFlight], rows: Dict[int, Any]) -> list:
        """[(matcher, token)] of the step in flight's constrained rows, each step once
        (whichever of launch and read comes first); [] when already taken."""
        if inflight is None or inflight is self._advanced:
            return []
        self._advanced = inflight
        pairs = [(i, r.matcher) for i, rid in enumerate(inflight.row_ids)
                 if (r := rows.get(rid)) is not None and r.matcher is not None]
        if not pairs:
            return []
        toks = self._tolist(inflight.tokens)
        return [(m, toks[i]) for i, m in pairs]

    def _tolist(self, tokens) -> list:
        tr = self.tracer
        t = pc() if tr else 0.0
        toks = tokens.tolist()  # the step in flight: done by now (module docstring)
        if tr:
            lap(tr, "mask.wait", t)
        return toks

    def advance(self, inflight: InFlight, rows: Dict[int, Any]) -> None:
        """Feed the step in flight's tokens to its constrained rows' matchers now."""
        _feed(self._read_tokens(inflight, rows))

    def start(self, inflight: Optional[InFlight], rows: Dict[int, Any],
              batch_rows: list) -> None:
        """Hand the step in flight's tokens to the fill threads, each of which feeds
        its share of the matchers and fills their next masks; `apply` collects them."""
        tr = self.tracer
        t = pc() if tr else 0.0
        if self._pos_for is not batch_rows:
            self._join(batch_rows)
        if not self._pos:
            _feed(self._read_tokens(inflight, rows))  # rows in flight that left still finish
        else:
            n = min(self._tasks, len(self._lanes))
            if (inflight is not None and inflight is not self._advanced
                    and inflight.row_ids == self._ids):
                # The step in flight holds exactly this batch (most steps): a row's
                # token sits at its batch position, and each task feeds its own rows.
                self._advanced = inflight
                toks, plan = self._tolist(inflight.tokens), self._plans.get(n)
                if plan is None:
                    plan = self._plans[n] = self._plan(n, lambda m, i: i)
            else:  # rows joined or left since it launched
                feed = self._read_tokens(inflight, rows)
                toks = [tk for _, tk in feed]
                at = {id(m): j for j, (m, _) in enumerate(feed)}
                plan = self._plan(n, lambda m, i: at.pop(id(m), -1))
                _feed([feed[j] for j in at.values()])  # rows that left the batch
            if self._filler is None:
                self._filler = ThreadPoolExecutor(self.threads, "mlxnb-masks")
            shares, bitmasks, order, stacked = plan
            self._pending = (order, stacked,
                             [self._filler.submit(_feed_and_fill, share, toks, bm)
                              for share, bm in zip(shares, bitmasks)])
        if tr:
            lap(tr, "mask.start", t)

    def _join(self, batch_rows: list) -> None:
        """A new batch membership: where its constrained rows sit, and their lanes."""
        self._pos_for = batch_rows
        self._pos = [i for i, r in enumerate(batch_rows) if r.matcher is not None]
        self._ids = [r.id for r in batch_rows]
        self._idx = ids(self._pos) if self._pos else None
        lanes: Dict[Any, list] = {}
        for k, i in enumerate(self._pos):
            r = batch_rows[i]
            lanes.setdefault(r.lane, []).append((k, r.matcher, i))
        self._lanes = list(lanes.values())
        self._plans = {}

    def _plan(self, n: int, token_at) -> tuple:
        """n fill tasks, each whole lanes in turn. Per task: its rows [(row in its
        bitmask, matcher, index of its token or -1)] and that bitmask (reused while
        the batch stays: a task writes every word of it, and copies it to the device
        before the next step's fill begins). Then where each constrained row's mask
        sits once the tasks' masks are stacked (None: in order), and each stacked
        mask's row (its index in the batch's constrained rows)."""
        shares, bitmasks, stacked = [], [], []
        for j in range(n):
            rows = [x for lane in self._lanes[j::n] for x in lane]
            shares.append([(b, m, token_at(m, i)) for b, (_, m, i) in enumerate(rows)])
            bitmasks.append(self.constraints.bitmask(len(rows)))
            stacked += [k for k, _, _ in rows]
        if stacked == sorted(stacked):
            return shares, bitmasks, None, stacked
        return (shares, bitmasks, ids(sorted(range(len(stacked)), key=stacked.__getitem__)),
                stacked)

    def apply(self, logits):
        """The batch's logits [B, V] with the constrained rows' masks applied. The
        forward's kernels are launched first, while the fill threads work."""
        tr = self.tracer
        t = t0 = pc()
        mx.async_eval(logits)  # the fill threads' llguidance work runs meanwhile
        launch = pc() - t0
        if tr:
            t = lap(tr, "mask.launch", t)
        pending, self._pending = self._pending, None
        if pending is None:
            self.allowed = {}
            return logits
        order, stacked, fills = pending
        done = [f.result() for f in fills]
        busy = sum(secs for secs, _, _ in done)
        counts = [n for _, _, c in done for n in c]
        self.allowed = {self._pos[k]: n for k, n in zip(stacked, counts)}
        # Next step: the fewest fill threads that finish within the launch. Each
        # busy core beside the worker slows its launch (~10-20% on an H200 host),
        # so threads that would only wait cost time.
        self._tasks = max(1, min(self.threads, math.ceil(1.25 * busy / max(launch, 1e-4))))
        if tr:
            t = lap(tr, "mask.join", t)
        if self._shifts is None:
            self._shifts = mx.arange(32, dtype=mx.uint32)
        words = done[0][1] if len(done) == 1 else mx.concatenate([w for _, w, _ in done])
        if order is not None:
            words = words[order]  # [constrained rows, W], in batch order
        if len(self._pos) == logits.shape[0]:
            return masked(logits, words, self._shifts)
        logits[self._idx] = masked(logits[self._idx], words, self._shifts)
        return logits

    def finish(self, r, emit, eos: set, ending: Optional[Ending]) -> Optional[Ending]:
        """After a constrained row's token is read: its Ending, or None. A complete
        grammar ends the row as its end-of-sequence token would."""
        m = r.matcher
        if m.is_error():
            err = m.get_error()
            if r.processors and _REFUSED in err:
                return Ending(Finish.ERROR, _NOTHING_LEFT)
            return Ending(Finish.ERROR, f"constraint failed: {one_line(err)}")
        if not m.is_stopped():
            return ending
        if ending is None:
            e = min(eos) if eos else -1
            return emit(e, {e})
        return Ending(Finish.STOP) if ending.reason == Finish.LENGTH else ending

    def reset(self) -> None:
        """Forget the batch (its rows left or failed); a fill still running is
        waited for, so no matcher is read after its row is gone."""
        pending, self._pending = self._pending, None
        if pending is not None:
            wait(pending[2])
        self._advanced = self._pos_for = self._idx = None
        self._pos, self._ids, self._lanes, self._plans = [], [], [], {}
        self.allowed = {}

    def close(self) -> None:
        self.reset()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None


def refused(m) -> bool:
    """Whether matcher `m` refused the last token fed to it (rather than failing on a
    limit while it computed the next mask, after taking that token)."""
    return m.is_error() and _REFUSED in m.get_error()


def fill(share: list, buf) -> None:
    """Each (row, matcher, token index)'s next-token bitmask into that row of `buf`.

    One matcher at a time: each call drops the GIL while it works, so fill threads
    run in parallel. llguidance's own thread pool (LLExecutor) cost more in
    hand-offs than the masks themselves at these sizes (32 rows mid-output, 2 CPU
    cores: 5 ms against 0.4 ms one by one)."""
    import llguidance.numpy as lln

    for k, m, _ in share:
        lln.fill_next_token_bitmask(m, buf, k)


def _feed_and_fill(share: list, toks: list, bitmask) -> tuple:
    """Feed each (row, matcher, token index)'s token (none at -1), fill its mask,
    and copy the bitmask to the device here, off the worker (MLX's CUDA arrays are
    managed memory: a host write to a page the device last touched faults it back,
    ~0.1 ms a step for 32 rows). Returns (seconds it took, words [rows, W], how many
    tokens each row allows)."""
    t = pc()
    _feed([(m, toks[i]) for _, m, i in share if i >= 0])
    fill(share, bitmask)
    words = mx.array(bitmask)
    counts = np.bitwise_count(bitmask.view(np.uint32)).sum(axis=1).tolist()
    return pc() - t, words, counts


def _feed(pairs: list) -> None:
    for m, tok in pairs:
        if not m.is_stopped():
            m.consume_token(tok)  # a refused token leaves m in its error state


def masked(logits, words, shifts):
    """logits [b, V] with every token whose bit is clear in words [b, W] (int32,
    llguidance's layout: token t is bit t % 32 of word t // 32) set to -inf. Tokens
    past the bitmask (padding rows of a larger embedding) are disallowed."""
    global _masked_compiled
    if _masked_compiled is None:
        # One fused pass instead of six over [b, V] (CPU, b=32, V=49152: ~4x faster).
        # Not shapeless: the slice to V fixes b; a new b re-traces (~ms), its kernel
        # is the same.
        _masked_compiled = mx.compile(_masked)
    return _masked_compiled(logits, words, shifts)


_masked_compiled = None


def _masked(logits, words, shifts):
    b, V = logits.shape
    bits = (words.astype(mx.uint32)[:, :, None] >> shifts) & 1  # [b, W, 32]
    allowed = bits.reshape(b, -1).astype(mx.bool_)
    n = allowed.shape[1]
    if n >= V:
        allowed = allowed[:, :V]
    else:
        allowed = mx.concatenate([allowed, mx.zeros((b, V - n), dtype=mx.bool_)], axis=1)
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
