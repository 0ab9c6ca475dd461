"""How much prompt to prefill per tick, and which forward shapes are new: the prefill's
policy, pure Python (its inputs are what ticks measured, its outputs token budgets).
`prefill.py` runs what it decides.
"""

from __future__ import annotations

from typing import Optional, Tuple

IDLE_PREFILL = 8192  # prompt tokens per tick when no row is decoding (none stalls)
IDLE_TICK_S = 0.25  # prefill compute per tick when idle, at the measured rate
PREFILL_BUCKET = 64  # joiners' prefill widths are multiples of this
# prefill_chunk=None ("auto"): prompt tokens per step beside a running batch = about
# STALL_S of prefill at the measured rate, a power of two in [AUTO_MIN, AUTO_MAX].
# A fixed 512 starved fast devices: on an H200 a 512-token chunk is ~1 ms of compute,
# so joiners waited dozens of steps (and every new chunk shape costs MLX's CUDA
# backend a one-off cuDNN graph build of 50-800 ms).
STALL_S = 0.05
AUTO_MIN, AUTO_MAX = 512, 8192


def pow2_floor(n: float) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


class ShapeMemory:
    """Forward shapes run before. The first forward of each shape pays one-off setup
    (tens to hundreds of ms on CUDA) that is not the prefill rate."""

    def __init__(self):
        self.seen: set = set()

    def first(self, key) -> bool:
        """Is this the first forward of shape `key`? (and remember it)"""
        if key in self.seen:
            return False
        if len(self.seen) > 100_000:
            self.seen.clear()
        self.seen.add(key)
        return True


class PrefillPolicy:
    """How many prompt tokens to prefill per tick: a fixed `chunk`, or sized by the
    prompt tokens/s that ticks measure. Pure Python: inputs are the observations,
    outputs the budgets."""

    def __init__(self, chunk: Optional[int] = None, prefill_rate: float = 0.0):
        self.chunk = chunk  # None: auto
        self.reset(prefill_rate)

    def reset(self, prefill_rate: float = 0.0):
        """Forget what ticks measured; `prefill_rate` (tokens/s) is the first estimate
        that sizes prefills, until ticks measure their own."""
        self.rate = prefill_rate  # best recent prompt tokens/s (see observe_prefill)
        self.rate_last = 0.0  # the latest tick's
        self.budget = AUTO_MIN  # auto tokens per step beside decode (step_budget)
        self.step_s = 0.0  # decode step time without prefill (moving average)

    def step_budget(self) -> int:
        """Prompt tokens to prefill per step beside the running batch."""
        if self.chunk:
            return self.chunk
        # Rise at once; fall only when the stall would pass twice STALL_S. The
        # measured rate wobbles by tens of percent (host noise, chunk sizes), and a
        # budget flipping between powers of two makes new chunk shapes, each with
        # its one-off setup on CUDA.
        want = self.rate * STALL_S
        if want >= self.budget or 2 * want < self.budget:
            self.budget = min(AUTO_MAX, max(AUTO_MIN, pow2_floor(want)))
        return self.budget

    @property
    def current(self) -> int:
        """The step budget as it stands (a read: changes nothing)."""
        return self.chunk or self.budget

    def plan(self, decoding: bool) -> Tuple[int, Optional[int]]:
        """(tokens to prefill this tick, most tokens a new group may hold; None: fit
        what is left of the tick)."""
        if decoding:
            # Auto: groups form from what is waiting, not from this tick's budget (it
            # follows a measured rate), so the same arrivals give the same prefill
            # shapes run after run; a group that does not fit what is left of this
            # tick waits whole for the next one rather than start as an odd chunk.
            return self.step_budget(), None if self.chunk else AUTO_MAX
        # Idle: the latest rate, not the best: this bounds how late a cancel lands.
        # Before any tick, the warm-up's measured one: from AUTO_MIN, a batch of 128
        # short prompts started in 4-token chunks per row, a new shape every tick
        # (0.25 s to first token on an H200).
        rate = self.rate_last or self.rate
        budget = int(min(IDLE_PREFILL, max(self.chunk or AUTO_MIN, rate * IDLE_TICK_S)))
        return budget, max(budget, IDLE_PREFILL)

    def observe_decode(self, seconds: float):
        """A decode step without prefill took `seconds`."""
        self.step_s += 0.2 * (seconds - self.step_s)

    def observe_prefill(self, tokens: int, seconds: float, decoding: bool, cold: bool):
        """A tick prefilled `tokens` in `seconds`; beside decoding rows that includes
        the decode step launched before it, which the running rows would wait for
        anyway: not part of the rate. Keep the best recent rate. A tick with a new
        shape (`cold`) pays one-off setup, so it under-reports: it may raise the
        estimate, never lower it. (Ignoring such ticks left a fresh engine at
        AUTO_MIN for most of its first run on CUDA, where most shapes are new.)"""
        if decoding:
            seconds = max(seconds - self.step_s, 0.25 * seconds)
        self.rate_last = tokens / max(seconds, 1e-6)
        self.rate = max(self.rate_last, (1.0 if cold else 0.9) * self.rate)
