"""What a step costs, and what to verify: measured wall seconds of plain and verifying
steps per batch size and width (`StepTimes`), the width with the most expected tokens
per second (`best_width`), the way to verify (pipelined or read back), and the guard
that turns speculation off at a batch size where it measures slower. The rows' side
(draft lengths, acceptance, pauses) is specpolicy.py's.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .specpolicy import expected_accepts

__all__ = ["StepTimes", "best_width"]


class StepTimes:
    """Measured wall seconds of decode steps per batch size: plain pipelined steps,
    and verification steps per width (averages, decayed). A verification's cost at a
    width is a line through the widths measured at that batch size once there are
    three (before: the width's own average, or the one measured: equal cost, which a
    first probe corrects); a batch size with
    no verification measured is taken to verify at a plain step's cost, so the
    first verification is tried and then measured.

    The guard, per group of batch sizes (`group`), judges two ways, and either
    turns speculation off for a hold that doubles each time (from HOLD to MAX_HOLD
    steps), then tries it again:
    * its speculating steps (verifications, and plain steps that waited for the
      step in flight to draft and found nothing) against the plain steps' average,
      below `FLOOR` of it;
    * every decode step while speculation is on (`observe_regime`: the plain steps
      between verifications too, which a verification slows when it empties the
      pipeline) against plain steps taken while it was held off, below `FLOOR`.
      Plain steps timed while speculation is on are not what plain decoding costs
      (on a GPU they measured 1.5x a plain step's time, so the first rule alone
      kept a slower speculation on), so until a hold has measured the baseline a
      short probe (PROBE steps) holds speculation off to measure it, unless the
      steps so far beat the plain average by CLEAR."""

    ALPHA = 0.25
    FLOOR = 0.97
    MIN_SPEC = 6  # speculating steps measured before the guard judges them
    HOLD, MAX_HOLD = 32, 2048
    REPROBE = 128  # speculating steps between tries of the way not chosen
    SWITCH = 1.05  # the other way must measure this much faster to be chosen
    FLOW = 0.9  # decay per step of the ways' token and time sums
    JUDGE = 16  # steps with speculation on before they are judged against held ones
    ON_DECAY = 0.97  # per step, of those steps' sums: a window of some 30 steps, as
    # copied spans and free text alternate within a row
    PROBE = 8  # steps held off to measure the baseline when none is measured
    SETTLE = 2  # a hold's first steps (the pipeline refilling) are not the baseline
    CLEAR = 1.6  # speculating steps this far above the plain average need no probe
    # a first verification slower than this many plain steps paid setup: measured
    # verifications of 2-16 positions cost 1.7-3.2 plain steps (H200, 2-core CPU), a
    # process's first of a shape 9 and more on a GPU (loading or compiling kernels)
    SETUP = 4

    def __init__(self):
        self.plain: Dict[int, float] = {}  # B -> seconds
        self.verify: Dict[int, Dict[int, float]] = {}  # B -> {W: seconds}
        # group(B) -> [speculating steps' tokens per row per plain step, steps]
        self._spec: Dict[int, list] = {}
        self._held: Dict[int, int] = {}  # group(B) -> steps left off
        self._hold: Dict[int, int] = {}  # group(B) -> the next hold
        self.holds = 0  # times the guard turned speculation off (tests, status)
        # B -> {way: [tokens/s average, steps]}: "wide" (pipelined, wide.py) or
        # "sync" (read back at once), and B -> [steps since a try of the other, way
        # being tried, steps left of that try]
        self._ways: Dict[int, Dict[str, list]] = {}
        # B -> {way: [tokens, seconds]} (decayed sums) over every decode step while
        # that way was in effect, plain ones too: what the ways are judged by
        self._flow: Dict[int, Dict[str, list]] = {}
        self._now: Dict[int, str] = {}  # B -> the way last chosen
        self._probe: Dict[int, list] = {}
        self.only: Optional[str] = None  # "wide" or "sync": that way always (tests, bench)
        self._cold: set = set()  # (B, width, way) seen once: the next ones are learnt from
        self._env: Dict[int, Dict[int, float]] = {}  # B -> `_envelope` of verify[B]
        self.skip_first = True  # (tests of the other rules turn it off)
        # group(B) -> [tokens per row, plain steps' time, steps] of every step since
        # speculation was last allowed (decayed), and [tokens per row, plain steps'
        # time] of steps held off (decayed), and group(B) -> steps into the hold
        self._on: Dict[int, list] = {}
        self._base: Dict[int, list] = {}
        self._into: Dict[int, int] = {}

    def way(self, B: int) -> str:
        """Pipelined or read-back verification at batch size B: each is tried for
        MIN_SPEC steps, then the one that gave more tokens per second is kept
        (until the other measures SWITCH times faster), and the other tried again
        every REPROBE steps (the text decides which wins:
        long copies favour pipelining, copies with edits break its chains).

        A way is judged by the tokens per second of every decode step taken while
        it was in effect (`observe_flow`), not of its verifying steps alone: a
        pipelined verification drafts ahead of tokens not yet read, so after a
        rejection the next one was stale, and the plain steps it leaves between
        verifications count as much as its cheaper reads."""
        self._now[B] = way = self._choose(B)
        return way

    def _choose(self, B: int) -> str:
        if self.only is not None:
            return self.only
        w = self._ways.setdefault(B, {"wide": [None, 0], "sync": [None, 0]})
        for name in ("sync", "wide"):  # the way that wastes no drafts first
            if w[name][1] < self.MIN_SPEC:
                return name
        f = self._flow[B]
        rate = {n: f[n][0] / f[n][1] if f[n][1] > 0 else 0.0 for n in f}
        p = self._probe.setdefault(B, [0, None, 0, None])  # [.., way kept]
        # first kept: the way that wastes no drafts, unless the other is clearly faster
        best = p[3] or "sync"
        other = "sync" if best == "wide" else "wide"
        if rate[other] > self.SWITCH * rate[best]:  # clearly faster: switch
            best, other = other, best
        p[3] = best
        if p[2] > 0:
            return p[1]
        if p[0] >= self.REPROBE:
            p[:3] = [0, other, self.MIN_SPEC]
            return other
        return best

    def observe_flow(self, B: int, seconds: float, tokens: int,
                     way: Optional[str] = None) -> None:
        """A decode step of B rows gave `tokens` in `seconds`: counted to `way`, or
        to the way in effect (none chosen yet: not counted)."""
        way = way or self._now.get(B)
        if way is None:
            return
        f = self._flow.setdefault(B, {"wide": [0.0, 0.0], "sync": [0.0, 0.0]})[way]
        f[0], f[1] = self.FLOW * f[0] + tokens, self.FLOW * f[1] + seconds

    def _avg(self, old: Optional[float], x: float) -> float:
        return x if old is None else old + self.ALPHA * (x - old)

    def observe_plain(self, B: int, seconds: float) -> None:
        self.plain[B] = self._avg(self.plain.get(B), seconds)

    def observe_spec(self, B: int, width: int, seconds: float, tokens: int,
                     way: str = "sync") -> bool:
        """A speculating step: `width` 1 for a plain step that drafted nothing. The
        first of each (batch size, width, way) is not learnt from where it may have
        paid one-off setup (on a GPU, compiling the kernels of that shape: seconds),
        which would otherwise rule that width out for good: where no plain step is
        measured near B, or it took over SETUP plain steps. (A CPU compiles
        nothing, and a wave of rows that shrinks as rows end would otherwise spend
        most of its verifications on firsts.) Returns whether it was learnt from."""
        if self.skip_first and (B, width, way) not in self._cold:
            self._cold.add((B, width, way))
            ref = self._plain_ref(B)
            if not ref or seconds > self.SETUP * ref:
                return False
        if width > 1:
            v = self.verify.setdefault(B, {})
            v[width] = self._avg(v.get(width), seconds)
            self._env.pop(B, None)
        w = self._ways.setdefault(B, {"wide": [None, 0], "sync": [None, 0]})[way]
        w[0], w[1] = self._avg(w[0], tokens / seconds), w[1] + 1
        self.observe_flow(B, seconds, tokens, way)
        p = self._probe.setdefault(B, [0, None, 0, None])
        p[0] += 1
        if p[2] > 0 and p[1] == way:
            p[2] -= 1
        # judged by group, in tokens per row per plain step's time at the step's own
        # size (plain decoding: 1), as observe_regime judges every step
        ref = self._plain_ref(B)
        if ref:
            s = self._spec.setdefault(self.group(B), [None, 0])
            s[0], s[1] = self._avg(s[0], (tokens / B) / (seconds / ref)), s[1] + 1
            if s[1] >= self.MIN_SPEC and s[0] < self.FLOOR:
                self._hold_off(B)
        return True

    def _plain_ref(self, B: int) -> Optional[float]:
        """A plain step's seconds at B, else at the nearest measured size (None)."""
        return self.plain.get(B) or self.plain.get(self.nearest(B) or 0)

    @staticmethod
    def group(B: int) -> int:
        """The batch sizes judged together by the guard: 1, 2, 3-4, 5-8, 9-16, ...
        A wave of rows shrinks one row at a time as rows end, so no single size
        gathers the steps a judgement needs; within a group the guard compares
        tokens per row per plain step's time at each step's own size."""
        return (B - 1).bit_length()

    def _hold_off(self, B: int, steps: Optional[int] = None) -> None:
        """Speculation off at B's group for `steps` (a probe), or for the next hold."""
        g = self.group(B)
        if steps is None:
            steps = self._hold.get(g, self.HOLD)
            self._hold[g] = min(2 * steps, self.MAX_HOLD)
            self.holds += 1
            self._spec[g] = [None, 0]  # judged afresh when tried again (a probe
            # only measures the baseline: what was judged so far stands)
        self._held[g] = steps
        self._on.pop(g, None)

    def observe_regime(self, B: int, seconds: float, tokens: int, held: bool) -> None:
        """A decode step of B rows gave `tokens` in `seconds` while speculation was
        held off (`held`) or on (whether or not this step verified); see the class
        docstring's second rule."""
        # each step's time in plain steps of its own size, so the sizes of a group
        # compare where a step's cost grows with B (a CPU) as where it does not
        ref = self._plain_ref(B)
        if not ref:
            return
        g, per_row, seconds = self.group(B), tokens / B, seconds / ref
        if held:
            n = self._into[g] = self._into.get(g, 0) + 1
            if n > self.SETTLE:
                b = self._base.setdefault(g, [0.0, 0.0])
                b[0], b[1] = self.FLOW * b[0] + per_row, self.FLOW * b[1] + seconds
            return
        self._into[g] = 0
        on = self._on.setdefault(g, [0.0, 0.0, 0])
        d = self.ON_DECAY
        on[0], on[1], on[2] = d * on[0] + per_row, d * on[1] + seconds, on[2] + 1
        if on[2] < self.JUDGE or on[1] <= 0:
            return
        rate = on[0] / on[1]  # tokens per row per plain step's time (plain: 1)
        base = self._base.get(g)
        if base is not None and base[1] > 0:
            if rate < self.FLOOR * base[0] / base[1]:
                self._hold_off(B)
            return
        if not rate > self.CLEAR:
            self._hold_off(B, self.PROBE)

    def allowed(self, B: int) -> bool:
        """May a batch of B rows speculate this step? (Counts down a hold.)"""
        g = self.group(B)
        left = self._held.get(g, 0)
        if left > 0:
            self._held[g] = left - 1
            return False
        return True

    def plain_s(self, B: int) -> Optional[float]:
        return self.plain.get(B)

    def nearest(self, B: int) -> Optional[int]:
        """The measured batch size nearest B by ratio (None: none measured)."""
        return min(self.plain, key=lambda b: max(b / B, B / b), default=None)

    def verify_s(self, B: int, W: int) -> Optional[float]:
        v = self.verify.get(B)
        if not v:
            return self.plain.get(B)
        env = self._envelope(B, v)
        ws = sorted(env)
        if W > ws[-1]:
            if len(ws) == 1:
                return env[ws[0]]
            # wider than any measured: on along the envelope's least-squares slope
            mx_, my = sum(ws) / len(ws), sum(env.values()) / len(ws)
            sxx = sum((x - mx_) ** 2 for x in ws)
            b = max(0.0, sum((x - mx_) * (env[x] - my) for x in ws) / sxx)
            return env[ws[-1]] + b * (W - ws[-1])
        hi = min(w for w in ws if w >= W)
        if hi == W:
            return env[W]
        # between two measured widths: the line between them. Narrower than any
        # measured: the line from a plain step (width 1), so that where each
        # position costs (a CPU) narrow widths get tried, and then measured
        lo = max((w for w in ws if w < W), default=None)
        if lo is not None:
            y0 = env[lo]
        else:
            lo, plain = 1, self.plain.get(B)
            y0 = min(plain, env[hi]) if plain else env[hi]
        return y0 + (env[hi] - y0) * (W - lo) / (hi - lo)

    def _envelope(self, B: int, v: Dict[int, float]) -> Dict[int, float]:
        """Width -> the least seconds measured at it or any wider width. A wider
        verification does all a narrower one does, so a width costs at most what
        any wider one measured: a width last measured on a busy host (or still cold)
        is then not ruled out by its own stale average while wider ones measure
        cheap -- the widths of a host-bound GPU cost about the same
        (bench/results/speculate-2026-12-02-h200.md). Kept until a verification
        at B is measured (best_width asks for every width, every step)."""
        env = self._env.get(B)
        if env is None:
            env, low = {}, float("inf")
            for w in sorted(v, reverse=True):
                low = env[w] = min(low, v[w])
            self._env[B] = env
        return env


def best_width(times: StepTimes, qs: List[float], lens: List[int],
               live: Optional[List[float]] = None) -> int:
    """The verification width (1 = a plain step) with the most expected tokens per
    second for rows whose drafts hold with probabilities `qs` and are `lens` long,
    and count at all with probabilities `live` (a guess that must hold first)."""
    B = len(lens)
    # a batch size measured: its own costs; else the nearest measured one's, whose
    # costs relative to its plain step are a batch size's next to it (a batch loses
    # rows one by one as they end, and the widest width tried blind costs most)
    src = B if times.plain_s(B) is not None else times.nearest(B)
    if src is None:
        return max(lens) + 1  # nothing measured yet: try it, then measure
    plain = times.plain_s(src)
    live = live or [1.0] * B
    best_w, best = 1, B / plain
    for w in range(2, max(lens) + 2):
        toks = B + sum(g * expected_accepts(q, min(n, w - 1))
                       for q, n, g in zip(qs, lens, live))
        v = toks / times.verify_s(src, w)
        if v > best:
            best_w, best = w, v
    return best_w
