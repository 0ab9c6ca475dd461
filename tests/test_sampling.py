"""The sampler alone, no model: what BatchSampler draws, against mlx-lm's samplers.

The reference distribution of every configuration is computed exactly from mlx-lm's
own sampler: `make_sampler`'s chain of filters (top-p, min-p, top-k) applied to the
log-softmax, and the logits its `categorical_sampling` would draw from, divided by
the temperature; repetition penalty from `make_logits_processors`, constraint masks
from masks.py's `masked`. BatchSampler then draws N tokens over many seeds (rows of
one batch with distinct seeds, a few steps each) and a chi-square test compares the
counts with N times the reference probabilities.

Power. Tokens are binned (the likeliest one by one, the rest by half-decades of the
reference's tail mass); for a sampler whose binned distribution q is at total
variation delta from the reference p, Pearson's statistic is approximately
noncentral chi-square with noncentrality N * sum (q - p)^2 / p >= 4 N delta^2. At
that least noncentrality, alpha = 1e-5 and power 0.99, `tv_detected` (noncentral
chi-square as a Poisson mixture of central ones; test_stated_power_holds checks the
figures) gives:
  small vocabulary, N = 65536 draws, at most 13 bins: any delta >= 0.017;
  real-size vocabulary, N = 4096 (T = 1, 9 bins): delta >= 0.062; N = 2048 (mask,
  8 bins): 0.087; N = 512 and 256 (top-k/min-p and mask/top-p, whose filters cost
  far more than the draw at this size; 11 and 5 bins): 0.18 and 0.24.
The tokens past the bins, those the reference expects fewer than 10 draws of all
together, are tested apart (Poisson upper tail), the negligible ones (under 1e-3
draws) on their own: at T = 1, a sampler that drew a uniformly random vocabulary
token once in 341 draws would put 9.4 of 4096 draws among those 38266 tokens, and
2 draws there are rejected, so it is caught with power 0.999. Tokens the reference
excludes (filtered or masked out) must get no draw at all. The seeds are fixed, so
every result here is deterministic; alpha only says how unlikely a wrong verdict
was when they were chosen.
"""

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)
import math
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import sample_utils
from mlx_lm.sample_utils import apply_min_p, apply_top_p, make_logits_processors

from mlxnb.core.worker.masks import masked
from mlxnb.core.worker.sampling import (_M2, MIN_TEMPERATURE, BatchSampler, _u32,
                                        gumbel_from_bits, gumbel_noise, top_logprobs)

ALPHA = 1e-5
NO_FILTERS = (0, 1.0, 0.0)


# -- statistics (float64; scipy is not a dependency) ----------------------------------

def gamma_pq(a: float, x: float):
    """(P, Q): the regularized lower and upper incomplete gamma functions (series
    below a + 1, Lentz's continued fraction above: each accurate where it is small)."""
    if x <= 0:
        return 0.0, 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        ap, term = a, 1.0 / a
        total = term
        while abs(term) > abs(total) * 1e-17:
            ap += 1
            term *= x / ap
            total += term
        p = total * math.exp(log_front)
        return p, 1.0 - p
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    i = 0
    while True:
        i += 1
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    q = math.exp(log_front) * h
    return 1.0 - q, q


def chi2_sf(x: float, df: int) -> float:
    return gamma_pq(df / 2, x / 2)[1]


def poisson_sf(k: int, lam: float) -> float:
    """P(X >= k) for X ~ Poisson(lam)."""
    return 1.0 if k <= 0 else gamma_pq(k, lam)[0]


def chi2_isf(alpha: float, df: int) -> float:
    lo, hi = 0.0, df + 100.0 + 20 * math.sqrt(df)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """Noncentral chi-square survival: a Poisson(lam / 2) mixture of chi2(df + 2j)."""
    h = lam / 2
    if h == 0:
        return chi2_sf(x, df)
    jmax = int(h + 12 * math.sqrt(h) + 60)
    return sum(math.exp(-h + j * math.log(h) - math.lgamma(j + 1)) * chi2_sf(x, df + 2 * j)
               for j in range(jmax + 1))


def tv_detected(n: int, bins: int, alpha: float = ALPHA, power: float = 0.99) -> float:
    """The total variation every larger binned deviation is detected at, with `power`."""
    crit = chi2_isf(alpha, bins - 1)
    lo, hi = 0.0, 10.0 * crit + 100
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(crit, bins - 1, mid) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))


def test_statistics_helpers_match_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(37.56623478662507, 20) == pytest.approx(0.01, rel=1e-9)
    assert chi2_sf(1e-3, 5) == pytest.approx(1 - 1.6817e-9, abs=1e-12)
    assert chi2_sf(200.0, 10) == pytest.approx(1.5604e-37, rel=1e-3)
    lam = 3.5
    for k in (0, 1, 4, 12):
        direct = 1 - sum(math.exp(-lam) * lam ** j / math.factorial(j) for j in range(k))
        assert poisson_sf(k, lam) == pytest.approx(direct, rel=1e-9, abs=1e-15)
    assert ncx2_sf(chi2_isf(0.05, 3), 3, 0.0) == pytest.approx(0.05, rel=1e-6)
    draws = np.random.default_rng(0).noncentral_chisquare(4, 30.0, 400_000)
    for x in (20.0, 34.0, 60.0):
        assert ncx2_sf(x, 4, 30.0) == pytest.approx((draws > x).mean(), abs=3e-3)


def test_stated_power_holds():
    for n, bins, delta in ((65536, 13, 0.017), (4096, 9, 0.062), (2048, 8, 0.087),
                           (512, 11, 0.18), (256, 5, 0.24)):
        assert tv_detected(n, bins) <= delta
    assert poisson_sf(2, 1e-3) < ALPHA / 4 and poisson_sf(2, 4096 / 341 * 38266 / 49152) > 0.999
    bins, rare = binned(reference(LONG, temp=1.0), 4096)
    assert len(bins) == 9 and rare[-1].size == 38266


def binned(p: np.ndarray, n: int):
    """(bins, rare bins) over the reference's support. Bins: each token with p >= 1/32
    alone, the rest by half-decades of the mass of the tokens less likely than it,
    while that mass is expected to get 10 draws or more. Rare bins, each tested apart
    (Poisson upper tail): the tokens past that, split where that mass is expected to
    get 1e-3 draws (the negligible tokens: a model's vocabulary is mostly such)."""
    ids = np.argsort(-p, kind="stable")
    ids = ids[p[ids] > 0]
    head = ids[p[ids] >= 1 / 32]
    tail = ids[len(head):]
    bins = [np.array([i]) for i in head]
    rare = []
    if len(tail):
        surv = np.cumsum(p[tail][::-1])[::-1]  # mass from each tail token on
        kept, ks = tail[surv * n >= 10], surv[surv * n >= 10]
        if len(kept):
            level = np.floor(-2 * np.log10(ks / ks[0])).astype(int)
            for lv in np.unique(level):
                bins.append(kept[level == lv])
        for sel in ((surv * n < 10) & (surv * n >= 1e-3), surv * n < 1e-3):
            if sel.any():
                rare.append(tail[sel])
    # merge bins expected to get under 5 draws into a neighbour
    out = []
    for b in bins:
        if out and n * p[out[-1]].sum() < 5:
            out[-1] = np.concatenate([out[-1], b])
        else:
            out.append(b)
    if len(out) > 1 and n * p[out[-1]].sum() < 5:
        out[-2] = np.concatenate([out[-2], out.pop()])
    return out, rare


def assert_distribution(tokens: np.ndarray, p: np.ndarray, what: str):
    """tokens: draws; p: the reference probabilities over the vocabulary."""
    n = tokens.size
    counts = np.bincount(tokens, minlength=p.size)
    outside = np.flatnonzero((counts > 0) & (p == 0))
    assert outside.size == 0, (f"{what}: drew {counts[outside].sum()} tokens the reference "
                               f"excludes, e.g. ids {outside[:8].tolist()}")
    bins, rare = binned(p, n)
    obs = np.array([counts[b].sum() for b in bins], dtype=np.float64)
    exp = np.array([p[b].sum() for b in bins]) * n
    for r in rare:  # the Pearson bins cover every draw: the rare ones count in the last
        obs[-1] += counts[r].sum()
        exp[-1] += p[r].sum() * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    pv = chi2_sf(stat, len(bins) - 1) if len(bins) > 1 else 1.0
    assert pv > ALPHA / 2, f"{what}: chi-square {stat:.1f} on {len(bins) - 1} df, p = {pv:.3g}"
    for r in rare:
        k, lam = int(counts[r].sum()), float(p[r].sum() * n)
        pr = poisson_sf(k, lam)
        assert pr > ALPHA / 2 / len(rare), (
            f"{what}: {k} draws of {r.size} rare tokens, expected {lam:.3g}, p = {pr:.3g}")


# -- the reference: mlx-lm's own sampler -------------------------------------------------

def mask_words(allowed: np.ndarray) -> mx.array:
    """llguidance's bitmask layout (token t is bit t % 32 of word t // 32) of `allowed`
    [b, V] as int32 words [b, W]."""
    b, V = allowed.shape
    pad = np.zeros((b, -V % 32), dtype=bool)
    bits = np.packbits(np.concatenate([allowed, pad], axis=1), axis=1, bitorder="little")
    return mx.array(bits.view(np.int32))


def prepare(logits: np.ndarray, rows: int, penalty=None, history=None, allow=None) -> mx.array:
    """[rows, V] logits as the worker hands them to the sampler: the row's logits
    processors (mlx-lm's repetition penalty), then its constraint mask."""
    x = mx.array(np.broadcast_to(np.asarray(logits, np.float32), (rows, len(logits))))
    if penalty is not None:
        for proc in make_logits_processors(repetition_penalty=penalty):
            x = proc(mx.array(history), x)
    if allow is not None:
        allowed = np.zeros((rows, len(logits)), dtype=bool)
        allowed[:, allow] = True
        x = masked(x, mask_words(allowed), mx.arange(32, dtype=mx.uint32))
    return x


def mlx_lm_logits(x: mx.array, temp: float, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The logits mlx-lm's make_sampler(...) draws from for logits x [1, V] (what
    generate_step passes it: their log-softmax), divided by its temperature."""
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    seen = {}

    def capture(logits, t):
        seen["z"] = logits * (1.0 / t)  # categorical_sampling's own scaling
        return mx.argmax(logits, axis=-1)

    if top_k >= x.shape[-1]:
        top_k = 0  # make_sampler refuses it; it keeps every token
    with mock.patch.object(sample_utils, "categorical_sampling", capture):
        sample_utils.make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)(lp)
    return np.array(seen["z"][0]).astype(np.float64)


def softmax64(z: np.ndarray) -> np.ndarray:
    p = np.zeros_like(z)
    fin = np.isfinite(z)
    e = np.exp(z[fin] - z[fin].max())
    p[fin] = e / e.sum()
    return p


def reference(logits, temp, top_k=0, top_p=1.0, min_p=0.0, penalty=None, history=None,
              allow=None) -> np.ndarray:
    return softmax64(mlx_lm_logits(prepare(logits, 1, penalty, history, allow), temp,
                                   top_k, top_p, min_p))


def draw(logits, temp, top_k=0, top_p=1.0, min_p=0.0, penalty=None, history=None,
         allow=None, rows=4096, steps=16) -> np.ndarray:
    """rows * steps tokens from one batch: row i has seed i, all share the logits."""
    x = prepare(logits, rows, penalty, history, allow)
    s = BatchSampler()
    s.extend([temp] * rows, [(top_k, top_p, min_p)] * rows, list(range(rows)), [0] * rows)
    out = []
    for _ in range(steps):
        t = s.sample(x)
        mx.eval(t)
        out.append(np.array(t))
    return np.concatenate(out).astype(np.int64)


# (a) a small vocabulary with a known, tie-free distribution; +3 puts the logits on
# both sides of 0, where the repetition penalty acts differently
P16 = np.array([.3, .2, .15, .1, .08, .06, .04, .03, .02, .01, .005, .003, .001, .0005,
                .0003, .0002])
SMALL = (np.log(P16) + 3).astype(np.float32)
ALLOW = [1, 2, 4, 7, 9, 12, 15]

SMALL_CONFIGS = {
    "T=0.3": dict(temp=0.3),
    "T=1": dict(temp=1.0),
    "T=2": dict(temp=2.0),
    "top_p=0.8": dict(temp=1.0, top_p=0.8),
    "top_k=5 T=1.5": dict(temp=1.5, top_k=5),
    "min_p=0.05": dict(temp=1.0, min_p=0.05),
    "top_p+min_p+top_k T=0.7": dict(temp=0.7, top_p=0.9, min_p=0.02, top_k=6),
    "repetition penalty": dict(temp=1.0, penalty=1.5, history=[0, 3, 7, 3, 12]),
    "repetition penalty+top_k T=2": dict(temp=2.0, penalty=0.7, history=[2, 9], top_k=8),
    "mask T=1.2": dict(temp=1.2, allow=ALLOW),
    "mask+top_k T=0.8": dict(temp=0.8, allow=ALLOW, top_k=3),
    "mask+top_p T=2": dict(temp=2.0, allow=ALLOW, top_p=0.7),
    "mask+min_p T=0.5": dict(temp=0.5, allow=ALLOW, min_p=0.1),
    # past float32's largest temperature: uniform over what the filters keep
    "top_k=5 T=1e39": dict(temp=1e39, top_k=5),
    "mask+top_p T=3.5e38": dict(temp=3.5e38, allow=ALLOW, top_p=0.7),
    "min_p T=1e300": dict(temp=1e300, min_p=0.05),
}


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_small_vocab_draws_follow_mlx_lms_distribution(name):
    cfg = SMALL_CONFIGS[name]
    p = reference(SMALL, **cfg)
    assert_distribution(draw(SMALL, **cfg), p, name)


def test_the_harness_accepts_mlx_lms_own_draws_and_rejects_a_skewed_sampler():
    cfg = SMALL_CONFIGS["top_p+min_p+top_k T=0.7"]
    z = mlx_lm_logits(prepare(SMALL, 1), cfg["temp"], cfg["top_k"], cfg["top_p"],
                      cfg["min_p"])
    p = softmax64(z)
    zz = mx.array(np.broadcast_to(z.astype(np.float32), (65536, 16)))
    own = np.array(mx.random.categorical(zz, key=mx.random.key(3))).astype(np.int64)
    assert_distribution(own, p, "mlx-lm's categorical")
    # the same draws with 2% of them moved to the likeliest token
    skew = own.copy()
    skew[: len(skew) // 50] = int(np.argmax(p))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(skew, p, "skewed")


# (b) a real vocabulary's size with a long tail: a Zipf head of 2000 tokens, then
# 47152 tokens 20-30 nats below the top (a model's vocabulary is mostly such tokens)
V_REAL = 49152


def long_tail() -> np.ndarray:
    rng = np.random.default_rng(0)
    lp = np.empty(V_REAL)
    lp[:2000] = -1.1 * np.log1p(np.arange(2000))
    lp[2000:] = -20 - 10 * rng.random(V_REAL - 2000)
    return (lp[rng.permutation(V_REAL)] + 5).astype(np.float32)


LONG = long_tail()
LONG_ALLOW = np.flatnonzero(np.random.default_rng(1).random(V_REAL) < 0.3)

# name: (config, rows, steps); the filters cost far more than the draw at this size
REAL_CONFIGS = {
    "T=1": (dict(temp=1.0), 512, 8),
    "mask T=0.8": (dict(temp=0.8, allow=LONG_ALLOW), 256, 8),
    "T=2 top_k=40 min_p=1e-3": (dict(temp=2.0, top_k=40, min_p=1e-3), 64, 8),
    "mask+top_p=0.95 T=0.7": (dict(temp=0.7, allow=LONG_ALLOW, top_p=0.95), 32, 8),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_vocab_draws_follow_mlx_lms_distribution(name):
    cfg, rows, steps = REAL_CONFIGS[name]
    p = reference(LONG, **cfg)
    assert_distribution(draw(LONG, **cfg, rows=rows, steps=steps), p, name)


# -- the noise ------------------------------------------------------------------------

def test_noise_is_finite_for_every_pattern_of_the_top_24_bits():
    """Every noise transform that reads at most the top 24 bits of a hash, on all of
    their values (low byte all 0s, then all 1s): a single +-inf would make its token
    win (or never win) whatever its logit."""
    top = mx.arange(1 << 24, dtype=mx.uint32) << 8
    for low in (0x00, 0xFF):
        g = gumbel_from_bits(top | low)
        bad = mx.logical_not(mx.isfinite(g))
        assert not bad.any().item(), f"non-finite noise at bits {np.flatnonzero(np.array(bad))[:4]}"


def _conversion_values():
    """Every value float32(bits) takes over all 2**32 uint32 bits: the integers below
    2**24, the float32 grid of each [2**m, 2**(m+1)) for m = 24..31, and 2**32."""
    yield mx.arange(1 << 24, dtype=mx.float32)
    j = mx.arange(1 << 23, dtype=mx.float32)
    for m in range(24, 32):
        yield 2.0 ** m + j * 2.0 ** (m - 23)
    yield mx.array([2.0 ** 32], dtype=mx.float32)


def test_noise_is_finite_and_accurate_on_every_value_of_all_2_32_bit_patterns():
    """The transform after the conversion, compiled as in the sampler's kernel, on
    every value the conversion can give: all 2**32 bit patterns, exhaustively.
    Finite, in [-2.82, 22.88], and (on every 16th value, and all of the upper tail's
    first 2**20) within 2e-6 of float64's -log(-log1p(-v)) for the float32 v (about
    one float32 step of the largest values), so E = exp(-g) to a relative 2e-6."""
    noise = mx.compile(gumbel_from_bits, shapeless=True)

    def error(f, g):
        v = mx.minimum((f + 0.5) * 2.0 ** -32, 1 - 2.0 ** -24).astype(mx.float64)
        return mx.max(mx.abs(g - -mx.log(-mx.log1p(-v)))).item()

    lo, hi, worst = np.inf, -np.inf, 0.0
    for n, f in enumerate(_conversion_values()):
        g = noise(f)
        assert mx.isfinite(g).all().item()
        lo, hi = min(lo, mx.min(g).item()), max(hi, mx.max(g).item())
        worst = max(worst, error(f[::16], g[::16]))
        if n == 0:
            worst = max(worst, error(f[: 1 << 20], g[: 1 << 20]))
            assert mx.array_equal(g, gumbel_from_bits(f)).item()  # compiled == eager
    assert worst < 2e-6, worst
    assert -2.82 < lo and hi < 22.88, (lo, hi)


def test_noise_moments_are_gumbels():
    # over a million hashes of consecutive ids; Gumbel's: Euler's gamma and pi^2/6
    ids = mx.arange(1 << 20, dtype=mx.uint32) * _u32(_M2)
    g = np.array(gumbel_noise(mx.array([7], dtype=mx.uint32), mx.array([3], dtype=mx.uint32),
                              ids)[0], np.float64)
    assert abs(g.mean() - 0.5772156649) < 6 * math.sqrt(math.pi ** 2 / 6 / g.size)
    assert abs(g.var() / (math.pi ** 2 / 6) - 1) < 0.01


# -- exact support ----------------------------------------------------------------------

def support(logits: np.ndarray, top_k=0, top_p=1.0, min_p=0.0, allow=None) -> np.ndarray:
    """Tokens a filtered, masked row may draw, ties at a filter's edge included: mlx-lm's
    top-p and min-p, then every token at least the k-th largest remaining logprob."""
    x = prepare(logits, 1, allow=allow)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        # any top_p at most the top token's probability keeps the top token and its
        # ties alone; 1e-30 is far below it and keeps mlx-lm's product normal
        lp = apply_top_p(lp, max(top_p, 1e-30))
    if min_p > 0:
        lp = apply_min_p(lp, min_p)
    lp = np.array(lp[0])
    ok = np.isfinite(lp)
    if 0 < top_k < lp.size:
        ok &= lp >= np.sort(lp)[-top_k]
    return ok


def test_every_draw_has_a_finite_filtered_logit_in_a_mixed_batch():
    """1024 rows of mixed temperatures, filters and masks over a 4096-token
    vocabulary (8 logit rows and masks x 16 settings, 8 seeds each), 12 steps: 12288
    draws, each checked against its row's support. A noise value that made one
    vocabulary id in 2**24 win would show here about 3 times (mostly masked ids)."""
    V, rows, steps = 4096, 1024, 12
    rng = np.random.default_rng(5)
    logit_rows = (rng.standard_normal((8, V)) * 3).astype(np.float32)
    allows = [None] + [np.flatnonzero(rng.random(V) < f) for f in (0.5, 0.05, 0.002)] * 3
    # top-p sorts the vocabulary: one setting in 16 each
    settings_ = [(0.7, NO_FILTERS), (1.0, (20, 1.0, 0.0)), (0.5, (0, 1.0, 0.05)),
                 (2.0, (50, 1.0, 0.01)), (1.0, (1, 1.0, 0.0)), (0.0, NO_FILTERS),
                 (1.3, NO_FILTERS), (3.0, (2, 1.0, 0.0))] * 2
    settings_[6], settings_[14] = (1.3, (0, 0.9, 0.0)), (4.0, (0, 1e-45, 0.0))
    combos = [(i, j) for i in range(8) for j in range(16)]
    x = np.empty((rows, V), np.float32)
    allowed = np.ones((rows, V), bool)
    temps, filters, sup = [], [], {}
    for r in range(rows):
        i, j = combos[r % len(combos)]
        x[r] = logit_rows[i]
        if allows[i] is not None:
            allowed[r] = False
            allowed[r, allows[i]] = True
        t, f = settings_[j]
        temps.append(t)
        filters.append(f)
        if (i, j) not in sup:
            sup[i, j] = support(logit_rows[i], *f, allow=allows[i]) if t > 0 else None
    logits = masked(mx.array(x), mask_words(allowed), mx.arange(32, dtype=mx.uint32))
    s = BatchSampler()
    s.extend(temps, filters, list(range(rows)), [0] * rows)
    greedy = np.array(mx.argmax(logits, axis=-1))
    ok = np.zeros((rows, V), bool)
    for r in range(rows):
        if temps[r] > 0:
            ok[r] = sup[combos[r % len(combos)]]
        else:
            ok[r, greedy[r]] = True
    bad = []
    for _ in range(steps):
        toks = np.array(s.sample(logits)).astype(np.int64)
        for r in np.flatnonzero(~ok[np.arange(rows), toks]):
            bad.append((int(r), int(toks[r]), float(x[r, toks[r]]), bool(allowed[r, toks[r]])))
    assert not bad, f"{len(bad)} draws outside their row's support, e.g. {bad[:5]}"


# -- properties ---------------------------------------------------------------------------

VOCABS = st.sampled_from([2, 3, 7, 40, 300])
TEMPS = st.sampled_from([1e-39, 1e-6, MIN_TEMPERATURE, 0.05, 0.3, 1.0, 4.0, 1e4])
# Few values: mlx-lm's filters take min_p (and the reference top_p) as constants of a
# compiled kernel, and each new one compiles anew (about a second on the CPU).
TOP_P = st.sampled_from([1.0, 5e-324, 1e-45, 1e-30, 1e-3, 0.1, 0.5, 0.9, 0.99])
MIN_P = st.sampled_from([0.0, 0.0, 0.01, 0.2, 0.9, 0.999])


@st.composite
def rows(draw_, min_allowed=1):
    V = draw_(VOCABS)
    # few distinct values: ties everywhere, at the top and at every filter's edge
    values = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.5, -30.0]),
                       st.floats(-1e4, 1e4, width=32))
    logits = np.array(draw_(st.lists(values, min_size=V, max_size=V)), np.float32)
    allowed = np.array(draw_(st.lists(st.booleans(), min_size=V, max_size=V)))
    if allowed.sum() < min_allowed:
        allowed[draw_(st.integers(0, V - 1))] = True
    return logits, np.flatnonzero(allowed)


def _sample_one(logits, allow, temp, filters, seed, counter, position=0, others=0):
    """The token a row draws at `position` of a batch of 1 + others rows (the others
    get their own logits, temperatures and filters)."""
    V = len(logits)
    rng = np.random.default_rng(seed % 1000)
    B = 1 + others
    x = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    x[position] = logits
    allowed = rng.random((B, V)) < 0.7
    allowed[position] = False
    allowed[position, allow] = True
    temps = [float(t) for t in rng.choice([0.0, 0.5, 1.5], B)]
    filt = [[NO_FILTERS, (3, 1.0, 0.0), (0, 0.8, 0.1)][k] for k in rng.integers(0, 3, B)]
    seeds = [int(v) for v in rng.integers(0, 2 ** 32, B)]
    temps[position], filt[position], seeds[position] = temp, filters, seed
    s = BatchSampler()
    s.extend(temps, filt, seeds, [counter] * B)
    out = s.sample(masked(mx.array(x), mask_words(allowed), mx.arange(32, dtype=mx.uint32)))
    return int(out[position].item())


SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(row=rows(), temp=TEMPS, top_k=st.integers(0, 320), top_p=TOP_P,
       min_p=MIN_P, seed=st.integers(0, 2 ** 32 - 1),
       counter=st.integers(0, 2 ** 32 - 1))
def test_a_draw_is_always_in_its_rows_filtered_masked_support(row, temp, top_k, top_p,
                                                              min_p, seed, counter):
    logits, allow = row
    tok = _sample_one(logits, allow, temp, (top_k, top_p, min_p), seed, counter)
    assert tok in set(allow.tolist())
    if temp < MIN_TEMPERATURE:
        masked_logits = np.full(len(logits), -np.inf, np.float32)
        masked_logits[allow] = logits[allow]
        assert tok == int(np.argmax(masked_logits))
    else:
        assert support(logits, top_k, top_p, min_p, allow)[tok]


@SETTINGS
@given(row=rows(), temp=st.floats(MIN_TEMPERATURE, 1e4), top_p=TOP_P,
       min_p=MIN_P, seed=st.integers(0, 2 ** 32 - 1),
       counter=st.integers(0, 2 ** 32 - 1), others=st.integers(0, 5), data=st.data())
def test_top_k_1_is_greedy_alone_or_anywhere_in_a_batch(row, temp, top_p, min_p, seed,
                                                        counter, others, data):
    logits, allow = row
    pos = data.draw(st.integers(0, others))
    masked_logits = np.full(len(logits), -np.inf, np.float32)
    masked_logits[allow] = logits[allow]
    tok = _sample_one(logits, allow, temp, (1, top_p, min_p), seed, counter, pos, others)
    assert tok == int(np.argmax(masked_logits))  # the lowest id among tied maxima


@SETTINGS
@given(row=rows(), temp=TEMPS, top_k=st.integers(0, 320), top_p=TOP_P,
       min_p=MIN_P, seed=st.integers(0, 2 ** 32 - 1),
       counter=st.integers(0, 2 ** 32 - 1), data=st.data())
def test_a_mask_allowing_one_token_always_yields_it(row, temp, top_k, top_p, min_p,
                                                    seed, counter, data):
    logits, _ = row
    only = data.draw(st.integers(0, len(logits) - 1))
    tok = _sample_one(logits, np.array([only]), temp, (top_k, top_p, min_p), seed, counter)
    assert tok == only


@SETTINGS
@given(row=rows(), temp=TEMPS, top_k=st.integers(0, 320), top_p=TOP_P,
       min_p=MIN_P, seed=st.integers(0, 2 ** 32 - 1),
       counter=st.integers(0, 2 ** 32 - 1), others=st.integers(1, 5), data=st.data())
def test_a_seeded_row_draws_the_same_alone_or_at_any_batch_position(
        row, temp, top_k, top_p, min_p, seed, counter, others, data):
    logits, allow = row
    pos = data.draw(st.integers(0, others))
    f = (top_k, top_p, min_p)
    assert (_sample_one(logits, allow, temp, f, seed, counter)
            == _sample_one(logits, allow, temp, f, seed, counter, pos, others))


def test_tiny_temperatures_are_greedy_and_the_smallest_sampled_one_does_not_overflow():
    x = mx.array([[3.0, 50.0, 49.9999, -50.0], [1e4, -1e4, 9999.0, 0.0]])
    for t in (1e-39, 1e-20, MIN_TEMPERATURE * 0.99):
        s = BatchSampler()
        s.extend([t, t], [NO_FILTERS] * 2, [1, 2], [0, 0])
        assert np.array(s.sample(x)).tolist() == [1, 0]
    s = BatchSampler()
    s.extend([MIN_TEMPERATURE] * 2, [NO_FILTERS] * 2, [1, 2], [0, 0])
    assert np.array(s.sample(x)).tolist() == [1, 0]  # gaps of 1e-4 / 1e-5 = 10 and 1e8


# -- logprobs ------------------------------------------------------------------------------

def _logprobs_case(allow=None):
    """A batch of four rows of one logits row (sampled filtered, sampled plain, greedy
    with filters, sampled top-k), sampled, with their reference distributions."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(300) * 2).astype(np.float32)
    cfgs = [(0.7, (5, 0.9, 0.0)), (1.3, NO_FILTERS), (0.0, (3, 0.5, 0.1)),
            (2.0, (40, 1.0, 0.02))]
    x = prepare(logits, len(cfgs), allow=allow)
    s = BatchSampler()
    s.extend([t for t, _ in cfgs], [f for _, f in cfgs], [3, 4, 5, 6], [0] * 4)
    toks = s.sample(x)
    refs = []
    for t, (k, p, m) in cfgs:
        if t == 0:  # greedy: the model's distribution after processors and mask, T = 1
            z = np.array(x[0], np.float64)
        else:
            z = mlx_lm_logits(x[:1], t, k, p, m)
        refs.append(log_softmax64(z))
    return s, toks, refs


def log_softmax64(z: np.ndarray) -> np.ndarray:
    m = z[np.isfinite(z)].max()
    return z - m - np.log(np.exp(z[np.isfinite(z)] - m).sum())


@pytest.mark.parametrize("allow", [None, ALLOW + [30, 31, 99, 250]], ids=["filtered", "constrained"])
def test_logprobs_are_those_of_the_distribution_drawn_from(allow):
    s, toks, refs = _logprobs_case(allow)
    idx = mx.array([0, 1, 2, 3])
    k = 8
    chosen, top, top_lp = s.logprobs(idx, toks[idx], k)
    chosen, top, top_lp = np.array(chosen), np.array(top), np.array(top_lp)
    for j, ref in enumerate(refs):
        tok = int(toks[j].item())
        assert np.isfinite(chosen[j]) and chosen[j] == pytest.approx(ref[tok], abs=1e-5)
        want = np.argsort(-ref, kind="stable")[:k]
        np.testing.assert_allclose(top_lp[j], ref[want], atol=1e-5)
        fin = np.isfinite(ref[want])
        assert top[j][fin].tolist() == want[fin].tolist()
        assert np.all(np.isneginf(top_lp[j][~fin]))  # excluded: not alternatives
        if allow is not None:
            assert set(top[j][fin].tolist()) <= set(allow)
    # row 0 (top-k 5, top-p 0.9): its alternatives are its whole support, whose
    # probabilities sum to 1
    assert np.isneginf(top_lp[0][5:]).all()
    assert np.exp(top_lp[0]).sum() == pytest.approx(1.0, abs=1e-5)


def test_logprobs_of_an_all_greedy_step_are_the_models():
    x = mx.array(np.random.default_rng(2).standard_normal((3, 50)).astype(np.float32))
    s = BatchSampler()
    s.extend([0.0] * 3, [(5, 0.5, 0.0)] * 3, [0, 1, 2], [0] * 3)
    toks = s.sample(x)
    idx = mx.array([2, 0])
    got = s.logprobs(idx, toks[idx], 4)
    want = top_logprobs(x[idx], toks[idx], 4)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)
    assert s.logprobs(idx, toks[idx], 0)[1:] == (None, None)


def test_logprobs_of_one_filter_group_and_of_top_k_1_rows():
    x = mx.array(np.random.default_rng(4).standard_normal((3, 60)).astype(np.float32))
    s = BatchSampler()
    s.extend([0.9] * 3, [(7, 1.0, 0.0)] * 3, [0, 1, 2], [0] * 3)  # one group: every row
    toks = s.sample(x)
    idx = mx.array([1, 2])
    chosen, top, top_lp = (np.array(a) for a in s.logprobs(idx, toks[idx], 7))
    for j, r in enumerate((1, 2)):
        ref = log_softmax64(mlx_lm_logits(x[r:r + 1], 0.9, top_k=7))
        assert chosen[j] == pytest.approx(ref[int(toks[r].item())], abs=1e-5)
        np.testing.assert_allclose(top_lp[j], np.sort(ref)[::-1][:7], atol=1e-5)
    # top_k = 1 rows (alone, then beside a drawing row): the point mass on their token
    for temps in ([0.5, 2.0], [0.5, 2.0, 1.0]):
        s = BatchSampler()
        s.extend(temps, [(1, 1.0, 0.0)] * 2 + [NO_FILTERS] * (len(temps) - 2),
                 [5, 6, 7][:len(temps)], [0] * len(temps))
        toks = s.sample(x[:len(temps)])
        chosen, top, top_lp = (np.array(a) for a in s.logprobs(mx.array([0, 1]), toks[:2], 3))
        assert chosen.tolist() == [0.0, 0.0]
        assert top[:, 0].tolist() == np.array(toks[:2]).tolist()
        assert np.isneginf(top_lp[:, 1:]).all()
        assert np.array(toks[:2]).tolist() == np.array(mx.argmax(x[:2], axis=-1)).tolist()
