"""Vectorized per-row sampling over a batch of logits.

Each row's randomness comes from a counter-based hash of (row seed, token index,
vocab id), not from a global RNG: a seeded row draws the same tokens whether it runs
alone or at any position of any batch. Sampling is the Gumbel-max trick,
argmax(logits / T + g), with g computed from that hash on the device for all rows at
once. Truncation filters (top-k, top-p, min-p) are mlx-lm's, applied per group of rows
that share them: top-k is mlx-lm's function, top-p and min-p are its arithmetic in
plain ops (`top_p_filter`, `min_p_filter`), which give the same logits bit for bit.

What a sampled row draws is exactly categorical(softmax(filtered / T)), where
`filtered` is the logits it is given (after processors and constraint masks) with
the filters applied to their log-softmax: the noise is finite for every hash value,
so a token whose filtered logit is -inf (masked or filtered out) never wins, and one
with a finite filtered logit wins with its softmax probability (to within the 32-bit
quantization of the noise). `BatchSampler.logprobs` reports that same distribution.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k

from .tokens import ids

# Temperatures below this sample greedily. Dividing float32 logits by a subnormal
# temperature (1e-39) overflows them to inf, and argmax over tied infs picks the
# lowest id whatever the logits were. Greedy differs from a draw at T only among
# tokens within 25.7 T of the top logit (the noise spans [-2.82, 22.88]): below 1e-5,
# logit gaps under 2.6e-4, less than one bfloat16 step of any logit of magnitude
# above 1/16.
MIN_TEMPERATURE = 1e-5
# Temperatures above this draw at it. Past float32's largest (3.4e38) a temperature
# is inf on the device, and an excluded token's -inf / inf is NaN, which argmax
# prefers. At 1e38 every kept logit / T is ~0: a uniform draw over the tokens the
# filters keep, as any larger temperature would give.
MAX_TEMPERATURE = 1e38

# top_p_filter keeps the tokens whose mass above them is below top_p * total. When that
# product underflows to 0 (top_p = 1e-45 is 0 in float32) every token counts as
# dropped and no token would be kept. Any top_p at or below the top token's
# probability keeps just the top token (and its ties); the top token of a row with V
# finite logits has probability >= 1/V, far above this floor, so the floor changes no
# row and keeps the product a normal float.
_MIN_TOP_P = 1e-30

_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9

# The largest float32 below 1.
_BELOW_ONE = 1.0 - 2.0 ** -24


def _u32(x: int) -> mx.array:
    return mx.array(x, dtype=mx.uint32)


def _fmix32(h: mx.array) -> mx.array:
    # murmur3's finalizer: a bijection on uint32 with full avalanche.
    h = h ^ (h >> 16)
    h = h * _u32(_M1)
    h = h ^ (h >> 13)
    h = h * _u32(_M2)
    return h ^ (h >> 16)


def gumbel_from_bits(bits: mx.array) -> mx.array:
    """Gumbel(0, 1) noise from uniform uint32 `bits`, finite for every bit pattern.

    v = (bits + 1/2) / 2**32 is uniform on (0, 1). Converting bits to float32 rounds
    it to 24 significant bits, which keeps v's full relative resolution near 0 (the
    noise's upper tail, which decides when an unlikely token wins) but can round the
    top 128 patterns up to exactly 1; the clamp to the largest float below 1 moves
    that 2**-25 of mass by one float32 step. Then E = -log1p(-v) is Exp(1), in
    [2**-33, 16.7], so positive and finite, and g = -log(E) lies in [-2.82, 22.88].
    Passing float32 values instead of uint32 bits runs the same transform from the
    conversion on (the tests enumerate every value the conversion can produce).
    """
    v = mx.minimum((bits.astype(mx.float32) + 0.5) * (2.0 ** -32), _BELOW_ONE)
    # log1p(-v) as log(w) * (-v) / (w - 1), w = 1 - v rounded: w - 1 is exact, so the
    # ratio undoes the rounding of w (Goldberg's trick; CPU log1p costs 60% more than
    # log here). w == 1 only for v < 2**-25, where -log1p(-v) is v to float precision.
    w = 1.0 - v
    e = mx.where(w == 1.0, v, -mx.log(w) * (v / (1.0 - w)))
    return -mx.log(e)


def gumbel_noise(seeds: mx.array, counters: mx.array, vocab_ids: mx.array) -> mx.array:
    """Gumbel(0, 1) noise [B, V] from per-row seeds [B], token counters [B] and
    `vocab_ids` = arange(V) * _M2 (all uint32)."""
    row_key = _fmix32(seeds ^ _fmix32(counters * _u32(_GOLDEN) + _u32(0x7F4A7C15)))
    return gumbel_from_bits(_fmix32(row_key[:, None] ^ vocab_ids[None, :]))


def _gumbel_argmax_unfused(logits, temp, seeds, counters, vocab_ids):
    t = mx.where(temp > 0, temp, 1.0)[:, None]
    return mx.argmax(logits / t + gumbel_noise(seeds, counters, vocab_ids), axis=-1)


# One fused kernel instead of ~15 elementwise passes over [B, V] (measured on the
# CPU: 13-15% faster at B >= 32, same tokens); shapeless, so batch size changes
# don't recompile.
_gumbel_argmax_fused = partial(mx.compile, shapeless=True)(_gumbel_argmax_unfused)
_gumbel_argmax = _gumbel_argmax_fused


def use_fused(on: bool) -> None:
    """Draw with the fused kernel (on) or the same ops unfused: precompile.py turns
    it off while the fused kernel compiles in the background."""
    global _gumbel_argmax
    _gumbel_argmax = _gumbel_argmax_fused if on else _gumbel_argmax_unfused


def top_p_filter(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """mlx-lm's `apply_top_p` (nucleus filter) of logprobs [B, V] at top_p (a float32
    scalar array), bit for bit, in ops that MLX ships built.

    mlx-lm's is an `mx.compile`d function: on CUDA its first call compiles two fused
    kernels and a gather with NVRTC, one after another, some 20 s on a fresh host
    (bench/results/first-token-2026-12-06-h100.md), which a top-p row's first token
    waited for. Sort, cumsum, reductions and elementwise ops compile nothing, so here
    the threshold, sorted[number dropped], is the smallest sorted logprob at or past
    that position, not a gather (equal: sorted ascends)."""
    ordered = mx.sort(logprobs, axis=-1)  # [B, V] ascending
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)  # [B, 1]
    at = mx.arange(logprobs.shape[-1], dtype=dropped.dtype)
    threshold = mx.min(mx.where(at >= dropped, ordered, mx.inf), axis=-1, keepdims=True)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """mlx-lm's `apply_min_p` (keeping one token at least), bit for bit, in plain ops:
    compiled, each new min_p value is a constant of a new fused kernel, which on CUDA
    is an NVRTC compile of seconds in the middle of a running batch."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs < floor, -mx.inf, logprobs)


def _apply_filters(logprobs: mx.array, top_k: int, top_p: float, min_p: float) -> mx.array:
    """mlx-lm's top-p, min-p and top-k of `logprobs`, in mlx-lm's order. Each keeps
    the top token, so a row with any finite logprob keeps at least one."""
    out = logprobs
    if 0 < top_p < 1.0:
        # as an array, as mlx-lm's takes it: the same float32 product with the total
        out = top_p_filter(out, mx.array(max(top_p, _MIN_TOP_P), dtype=mx.float32))
    if min_p > 0.0:
        out = min_p_filter(out, min_p)
    if 0 < top_k < out.shape[-1]:
        out = apply_top_k(out, top_k)
    return out


class TopLogprobs(NamedTuple):
    chosen: mx.array  # [b] the chosen token's logprob
    top_ids: Optional[mx.array]  # [b, k] most likely first (None when k <= 0)
    top_logprobs: Optional[mx.array]  # [b, k]


def _top(logprobs: mx.array, chosen: mx.array, k: int) -> TopLogprobs:
    chosen_lp = mx.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    if k <= 0:
        return TopLogprobs(chosen_lp, None, None)
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    return TopLogprobs(chosen_lp, mx.take_along_axis(top, order, axis=-1),
                       mx.take_along_axis(top_lp, order, axis=-1))


class BatchSampler:
    """Per-row sampling parameters of the running batch, kept as device arrays.

    Rows are appended and filtered in step with the batch's KV cache, so the hot
    path builds no per-row Python lists.

    A sampled row with top_k = 1 has one token to draw, its top one: it takes the
    argmax as a greedy row does (the lowest id among tied maxima), with no noise and
    no filters, and reports that one token's point mass as its logprobs.
    """

    def __init__(self):
        self.temps: List[float] = []
        self.filters: List[Tuple[int, float, float]] = []
        self.seeds: List[int] = []  # each row's seed, as uint32 values
        self._temp = None  # [B] float32: the temperature each row draws at, 0 = argmax
        self._point = None  # [B] bool: sampled rows with top_k = 1
        self._seeds = None  # [B] uint32
        self.counters = None  # [B] uint32: tokens sampled so far per row
        self._groups: Optional[Dict[tuple, Tuple[mx.array, int]]] = None
        self._any_sampled = False
        self._any_point = False
        self._vocab_ids = None  # arange(V) * _M2, the noise's per-token keys
        # what the last sample() drew from: (logits, each row's filtered where it has
        # filters [B, V]; its draw temperatures [B]; its top_k = 1 rows [B] or None)
        self._last: Optional[Tuple[mx.array, mx.array, Optional[mx.array]]] = None

    def __len__(self):
        return len(self.temps)

    @staticmethod
    def _draws(t: float, f: tuple) -> bool:
        return t > 0 and f[0] != 1

    def extend(self, temps: Sequence[float], filters: Sequence[tuple],
               seeds: Sequence[int], counters: Sequence[int]) -> None:
        temps = [min(t, MAX_TEMPERATURE) if t >= MIN_TEMPERATURE else 0.0 for t in temps]
        filters = list(filters)
        self.temps += temps
        self.filters += filters
        self.seeds += [s & 0xFFFFFFFF for s in seeds]
        counters = mx.array(list(counters), dtype=mx.uint32)
        self.counters = counters if self.counters is None else mx.concatenate(
            [self.counters, counters])
        self._host_arrays()

    def filter(self, keep: List[int]) -> None:
        self.temps = [self.temps[i] for i in keep]
        self.filters = [self.filters[i] for i in keep]
        self.seeds = [self.seeds[i] for i in keep]
        # counters advance on the device; the rest is rebuilt from the host lists
        # (no gather kernels of their own types to compile: tokens.py)
        self.counters = self.counters[ids(keep)] if keep else None
        self._host_arrays()

    def _host_arrays(self) -> None:
        """The per-row arrays that only change as rows come and go, from the host lists."""
        temps, filters = self.temps, self.filters
        if not temps:
            self._temp = self._point = self._seeds = self.counters = None
        else:
            self._temp = mx.array([t if self._draws(t, f) else 0.0
                                   for t, f in zip(temps, filters)], dtype=mx.float32)
            self._point = mx.array([t > 0 and f[0] == 1 for t, f in zip(temps, filters)],
                                   dtype=mx.bool_)
            self._seeds = mx.array(self.seeds, dtype=mx.uint32)
        self._changed()

    def _changed(self) -> None:
        self._groups = None
        self._any_sampled = any(self._draws(t, f) for t, f in zip(self.temps, self.filters))
        self._any_point = any(t > 0 and f[0] == 1 for t, f in zip(self.temps, self.filters))

    def _filter_groups(self) -> Dict[tuple, Tuple[mx.array, int]]:
        """The rows that draw with truncation filters, by their filters: (their batch
        positions, how many). Rows that take the argmax skip the filters, all of which
        keep the top token."""
        if self._groups is None:
            groups: Dict[tuple, List[int]] = {}
            for i, (t, f) in enumerate(zip(self.temps, self.filters)):
                if self._draws(t, f) and f != (0, 1.0, 0.0):
                    groups.setdefault(f, []).append(i)
            self._groups = {f: (ids(ix), len(ix)) for f, ix in groups.items()}
        return self._groups

    @property
    def needs_float32(self) -> bool:
        return self._any_sampled

    def sample(self, logits: mx.array, keep: bool = True) -> mx.array:
        """logits [B, V] (float32 where any row draws) -> tokens [B] uint32; advances
        the counters. `keep`: hold what the rows were drawn from for `logprobs` (a
        reference to a [B, V] array until the next call; steps whose rows want no
        logprobs pass False).

        A greedy row takes its argmax. A sampled row draws from softmax(filtered / T):
        only tokens with a finite filtered logit can be drawn. Logits must not be NaN
        (argmax prefers a NaN; nothing here makes one), and a row with no finite
        logit gets an arbitrary token."""
        if not self._any_sampled:
            # Counters only feed drawing rows' noise, and any such row keeps this
            # branch off while it is in the batch: argmax-only steps skip the update.
            self._last = (logits, self._temp,
                          self._point if self._any_point else None) if keep else None
            return mx.argmax(logits, axis=-1)
        greedy = mx.argmax(logits, axis=-1)
        sampled, x = self._draw(logits, self._filter_groups(), self._temp, self._seeds,
                                self.counters)
        self._last = (x, self._temp, self._point if self._any_point else None) if keep else None
        self.counters = self.counters + _u32(1)
        return mx.where(self._temp > 0, sampled, greedy)

    def _draw(self, logits, groups, temp, seeds, counters):
        """(Gumbel-max draws [N], the filtered logits they were drawn from [N, V]) for
        logits [N, V] whose rows draw at `temp` with these noise keys."""
        x = logits
        for (k, p, m), (idx, n) in groups.items():
            every = n == logits.shape[0]
            rows = logits if every else logits[idx]
            lp = _apply_filters(rows - mx.logsumexp(rows, axis=-1, keepdims=True), k, p, m)
            if every:
                x = lp
            else:
                if x is logits:
                    x = mx.array(logits)  # its own handle: the caller's logits stay as they are
                x[idx] = lp
        V = x.shape[-1]
        if self._vocab_ids is None or self._vocab_ids.shape[0] != V:
            self._vocab_ids = mx.arange(V, dtype=mx.uint32) * _u32(_M2)
        return _gumbel_argmax(x, temp, seeds, counters, self._vocab_ids), x

    def sample_wide(self, logits: mx.array, keep: bool = True) -> mx.array:
        """logits [B, W, V]: each row's next W positions (a verification forward) ->
        tokens [B, W], position j drawn exactly as `sample` would draw the row's
        token j steps from now: with noise counter (its counter + j). So a row whose
        drafts match these tokens gets, token for token, what decoding one token a
        step gives, and the draws are the same alone or in any batch. The counters
        do not move here: `advance` moves each row by the tokens it took. `keep`:
        as for `sample`, with the rows of `logprobs` indexing row i's position j
        at i * W + j."""
        B, W, V = logits.shape
        flat = logits.reshape(B * W, V)
        temp = mx.repeat(self._temp, W)
        point = mx.repeat(self._point, W) if self._any_point else None
        if not self._any_sampled:
            self._last = (flat, temp, point) if keep else None
            return mx.argmax(logits, axis=-1)
        wide = mx.arange(W, dtype=mx.uint32)
        counters = (self.counters[:, None] + wide[None, :]).reshape(-1)
        seeds = mx.repeat(self._seeds, W)
        groups = {f: ((idx[:, None] * W + mx.arange(W)[None, :]).reshape(-1), n * W)
                  for f, (idx, n) in self._filter_groups().items()}
        sampled, x = self._draw(flat, groups, temp, seeds, counters)
        self._last = (x, temp, point) if keep else None
        out = mx.where(temp > 0, sampled, mx.argmax(flat, axis=-1))
        return out.reshape(B, W)

    def row_keys(self, idx: mx.array):
        """For batch rows `idx` [n]: (draw temperatures [n], 0 = argmax; seeds [n];
        noise counters [n]), what other draws for those rows key their noise by."""
        return self._temp[idx], self._seeds[idx], self.counters[idx]

    def drawn_from(self):
        """What the last `sample`/`sample_wide(keep=True)` drew from: (logits with
        each drawing row's filters applied [N, V], draw temperatures [N], 0 = argmax)."""
        if self._last is None:
            raise RuntimeError("drawn_from() needs a sample(keep=True) call first")
        return self._last[0], self._last[1]

    def advance(self, taken: mx.array) -> None:
        """Move each row's noise counter by the tokens it took [B] (after
        `sample_wide`); only drawing rows read counters (see `sample`)."""
        if self._any_sampled:
            self.counters = self.counters + taken.astype(mx.uint32)

    def logprobs(self, idx: mx.array, chosen: mx.array, k: int):
        """Log-probabilities for rows `idx` [b] of the last `sample` call, whose tokens
        were `chosen` [b]: (logprob of chosen [b], top-k ids [b, k], their logprobs
        [b, k]), the last two None when k <= 0; top ids in descending logprob order.

        Each row's logprobs are those of the distribution its token was drawn from: a
        sampled row's log_softmax(filtered / T), filtered being the logits `sample`
        was given with the row's top-k/top-p/min-p applied (with top_k = 1, the point
        mass on its token); a greedy row's (T = 0) log_softmax(logits), its logits as
        `sample` was given them (after processors and constraint masks) at T = 1,
        unfiltered. So the chosen token's logprob is finite for a sampled row, and a
        token the distribution excludes has logprob -inf: where fewer than k tokens
        are possible, the remaining top entries are such tokens, with -inf, and are
        not alternatives (the caller drops them).

        Reads what `sample` already computed (it keeps a reference until its next
        call); call it after `sample` and before the batch's rows change."""
        if self._last is None:
            raise RuntimeError("logprobs() needs a sample(keep=True) call first")
        x, temp, point = self._last
        t = temp[idx]
        z = x[idx].astype(mx.float32) / mx.where(t > 0, t, 1.0)[:, None]
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        if point is not None:
            hit = mx.arange(x.shape[-1])[None, :] == chosen[:, None]
            lp = mx.where(point[idx][:, None], mx.where(hit, 0.0, -mx.inf), lp)
        return _top(lp, chosen, k)


def top_logprobs(logits: mx.array, chosen: mx.array, k: int):
    """For rows [b, V]: (logprob of chosen [b], top-k ids [b, k], top-k logprobs [b, k])
    of log_softmax(logits): the distribution of these logits at T = 1, unfiltered."""
    return _top(logits - mx.logsumexp(logits, axis=-1, keepdims=True), chosen, k)
