"""Draft-model speculation in the running batch: greedy exactness, the rejection
rule's distribution, seeded rows alone vs batched, the per-row policy, refusals."""

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from test_sampling import ALPHA, assert_distribution, chi2_sf

from mlxnb import Engine
from mlxnb.core.worker.draft import DEFAULT_K, FAILS_OFF, DraftRow
from mlxnb.core.worker.draftrule import reject_sample, vocab_keys
from mlxnb.models.tiny import tiny_model

PROMPTS = ["abc abc abc abc the cat", "hello world hello world hello",
           "The quick brown fox jumps over the lazy dog. The quick", "xyz"]
N = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model(layers=4)


async def _tokens(eng, prompts, batched, **kw):
    kw = dict(dict(max_tokens=N, chat=False), **kw)
    if batched:
        rows = [eng.submit(p, **kw) for p in prompts]
        return [await r for r in rows]
    return [await eng.submit(p, **kw) for p in prompts]


@pytest.mark.parametrize("draft", ["same weights", "layers:2", "random"])
def test_greedy_rows_are_token_identical_alone_and_batched(target, arun, draft):
    """Every draft: all kept (p == q: the catch-up forward of the last draft), some
    kept (layers:2: per-row rollbacks of both caches), none kept (auto-off)."""
    dm = {"same weights": lambda: tiny_model(layers=4), "layers:2": lambda: "layers:2",
          "random": lambda: tiny_model(seed=5)}[draft]()

    async def main():
        eng = Engine(target, kv_budget=None, warmup=False, draft_model=dm)
        base = await _tokens(eng, PROMPTS, False)
        alone = await _tokens(eng, PROMPTS, False, speculate="draft")
        # beside lookup rows, plain rows and sampled rows
        mixed = [eng.submit(p, max_tokens=N, chat=False, speculate=s, **kw)
                 for p in PROMPTS for s, kw in (("draft", {}), ("lookup", {}),
                                                (None, dict(temperature=1.0, seed=3)))]
        mixed = [await r for r in mixed]
        status = eng.status()
        await eng.aclose()
        return base, alone, mixed[::3], status

    base, alone, batched, status = arun(main)
    want = [r.tokens for r in base]
    assert [r.tokens for r in alone] == want
    assert [r.tokens for r in batched] == want
    rows = alone + batched
    proposed = sum(r.draft_proposed for r in rows)
    kept = sum(r.draft_accepted for r in rows)
    assert proposed > 0
    if draft == "same weights":
        assert kept == proposed
    elif draft == "layers:2":
        assert 0 < kept < proposed
    else:  # useless: each row probes a few times, then decodes plainly
        # (a chance agreement of two random models may cost a row a few more probes)
        assert sum(r.draft_proposed for r in rows) <= len(rows) * (DEFAULT_K + 2 * FAILS_OFF)
        assert all(r.draft_proposed < N // 2 for r in rows)
    assert "draft " in status and "draft acceptance" in status


def test_greedy_parity_with_sliding_window_target(tiny_swa, arun):
    async def main():
        eng = Engine(tiny_swa, kv_budget=None, warmup=False, draft_model="layers:1")
        base = await _tokens(eng, PROMPTS, False)
        spec = await _tokens(eng, PROMPTS, True, speculate="draft")
        await eng.aclose()
        return base, spec

    base, spec = arun(main)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert sum(r.draft_accepted for r in spec) > 0


def test_reported_kv_counts_the_draft_models_cache(target, arun):
    """A draft of the target's own size holds as much KV as the target: the memory
    chart and the budget's reports count both."""
    async def main():
        eng = Engine(target, kv_budget=None, warmup=False, draft_model=tiny_model(layers=4))
        await _tokens(eng, PROMPTS, True)
        n = len(eng.steps)
        spec = await _tokens(eng, PROMPTS, True, speculate="draft")
        await eng.aclose()
        return eng.steps[:n], eng.steps[n:], spec

    plain, spec, rows = arun(main)
    assert sum(r.draft_proposed for r in rows) > 0
    assert max(s.kv_bytes for s in spec) >= 1.5 * max(s.kv_bytes for s in plain)
    for s in spec:
        assert sum(s.row_kv_bytes.values()) <= s.kv_bytes


def test_first_layers_that_cannot_run_alone_are_refused_in_one_line():
    """A hybrid whose first full-attention layer is past N indexes it from outside
    the layer list: the cut-down draft fails its first forward."""
    m = tiny_model(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError) as e:
        Engine(m, kv_budget=None, warmup=False, draft_model="layers:1")
    msg = str(e.value)
    assert "layers:1" in msg and "another N" in msg and "\n" not in msg, msg


def test_a_seeded_sampled_row_is_the_same_alone_and_in_any_batch(target, arun):
    kw = dict(temperature=0.8, top_p=0.95, seed=7, speculate="draft")

    async def main():
        eng = Engine(target, kv_budget=None, warmup=False, draft_model="layers:2")
        alone = await _tokens(eng, PROMPTS, False, **kw)
        rows = [eng.submit(p, max_tokens=N, chat=False, **kw) for p in PROMPTS]
        # companions of other seeds, greedy ones, and one that joins late
        others = [eng.submit(p, max_tokens=N // 2, chat=False, speculate="draft",
                             temperature=1.0, seed=99) for p in PROMPTS[:2]]
        others.append(eng.submit(PROMPTS[2], max_tokens=N, chat=False, speculate="draft"))
        batched = [await r for r in rows]
        for r in others:
            await r
        await eng.aclose()
        return alone, batched

    alone, batched = arun(main)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    kept = sum(r.draft_accepted for r in alone)
    assert 0 < kept < sum(r.draft_proposed for r in alone)  # both branches of the rule


# -- the rejection rule's distribution ---------------------------------------------------

P3 = np.array([[.30, .25, .20, .12, .08, .05], [.05, .10, .15, .20, .20, .30],
               [.50, .05, .05, .10, .10, .20]])
Q3 = np.array([[.05, .05, .40, .30, .10, .10], [.30, .30, .10, .10, .10, .10],
               [.10, .10, .10, .10, .30, .30]])


def _rule(n, p=P3, q=Q3, wrong_residual=False):
    """n seeded rows, each drafting 3 tokens from q and judged against p (fixed
    distributions per position): the tokens each row emits at positions 0, 1, 2
    (-1: not emitted)."""
    K, V = p.shape
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.choice(V, size=n, p=q[j]) for j in range(K)], axis=1)
    logp = mx.array(np.broadcast_to(np.log(p), (n, K, V)).astype(np.float32))
    logq = mx.array(np.broadcast_to(np.log(q), (n, K, V)).astype(np.float32))
    if wrong_residual:  # a broken rule: resample from p, not max(0, p - q)
        logq = logq - 1e4
    seeds = mx.arange(n, dtype=mx.uint32)
    counters = mx.zeros((n,), dtype=mx.uint32) + 17
    bonus = mx.array(rng.choice(V, size=n, p=p[-1]).astype(np.int32))
    acc, nxt = reject_sample(logp, logq if not wrong_residual else logq, mx.array(
        drafts.astype(np.int32)), mx.full((n,), K, mx.int32), bonus, seeds, counters,
        vocab_keys(V))
    if wrong_residual:  # judged with the true q, resampled from p
        acc, _ = reject_sample(logp, mx.array(np.broadcast_to(np.log(q), (n, K, V)).astype(
            np.float32)), mx.array(drafts.astype(np.int32)), mx.full((n,), K, mx.int32),
            bonus, seeds, counters, vocab_keys(V))
    acc, nxt = np.array(acc), np.array(nxt)
    out = np.full((n, K), -1)
    for j in range(K):
        out[:, j] = np.where(acc > j, drafts[:, j], np.where(acc == j, nxt, -1))
    return out


def test_the_rejection_rule_keeps_the_targets_distribution_at_every_position():
    out = _rule(60000)
    for j in range(3):
        toks = out[:, j][out[:, j] >= 0]
        assert toks.size > 5000
        assert_distribution(toks, P3[j], f"position {j}")


def test_the_distribution_test_has_power_against_a_wrong_residual():
    """The test above, at its sample sizes, against the classic bug (resampling from p
    instead of max(0, p - q) after a rejection): the bug's position-0 distribution
    is q min(1, p/q) + (1 - sum min(p, q)) p, and the chi-square rejects it with
    power > 0.999 (noncentral chi-square, 5 df); run, the bug fails the test."""
    p, q = P3[0], Q3[0]
    bug = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p
    n = 60000
    lam = n * ((bug - p) ** 2 / p).sum()
    crit = next(x for x in np.arange(0, 200, 0.01) if chi2_sf(x, 5) < ALPHA / 2)
    sims = np.random.default_rng(1).noncentral_chisquare(5, lam, 20000)
    assert (sims > crit).mean() > 0.999
    out = _rule(n, wrong_residual=True)
    with pytest.raises(AssertionError):
        assert_distribution(out[:, 0][out[:, 0] >= 0], p, "position 0 (broken)")


def test_sampled_rows_in_the_engine_draw_the_targets_distribution(arun):
    """First tokens of 512 seeded rows (temperature 1, top-k 6: six bins), drafted by
    a different random model, against the target's own softmax."""
    tgt, tok = tiny_model(layers=2, seed=1)
    prompt = "hello world"
    ids = tok.encode(prompt)
    logits = np.array(tgt(mx.array([ids]))[0, -1].astype(mx.float32))
    top = np.argsort(-logits)[:6]
    p = np.zeros_like(logits, dtype=np.float64)
    p[top] = np.exp(logits[top] - logits[top].max())
    p /= p.sum()

    async def main():
        eng = Engine((tgt, tok), kv_budget=None, warmup=False, max_batch=64,
                     draft_model=tiny_model(layers=1, seed=9))
        rows = [eng.submit(prompt, max_tokens=2, chat=False, temperature=1.0, top_k=6,
                           seed=s, speculate="draft", num_draft=1) for s in range(512)]
        out = [await r for r in rows]
        await eng.aclose()
        return out

    out = arun(main, timeout=120)
    assert sum(r.draft_proposed for r in out) >= 512
    assert 0 < sum(r.draft_accepted for r in out) < 512  # both branches ran
    assert_distribution(np.array([r.tokens[0] for r in out]), p, "first tokens")


# -- the per-row policy and refusals -----------------------------------------------------

def test_draft_rows_joining_a_lookup_row_that_verifies_ahead(arun):
    """Sampled draft rows too short to draft (max_tokens 1) keep joining while a lookup
    row verifies ahead of the step in flight: the draft model proposes only when its
    draft is due, so no row is judged on a proposal that was never verified (a token
    id out of the vocabulary, or every row failed by its stale state)."""
    m, tok = tiny_model()

    async def main():
        eng = Engine((m, tok), kv_budget=None, warmup=False, draft_model=tiny_model(seed=5))
        eng._exec.spec.times.only = "sync"  # read-back verification, on any device
        eng._exec.eos = set()  # the lookup row runs its whole length
        lookup = eng.submit("abc abc abc abc abc abc abc abc abc", chat=False,
                            max_tokens=200, speculate="lookup", num_draft=4)
        short = []
        for i in range(200):
            if lookup.done:
                break
            short.append(await eng.submit("hello hello", chat=False, max_tokens=1,
                                          temperature=1.0, seed=i, speculate="draft"))
        lookup.cancel()
        res = await lookup
        await eng.aclose()
        return res, short, lookup.draft_proposed

    res, short, proposed = arun(main)
    assert res.error is None and len(res.tokens) == 200 and proposed > 0
    V = m.args.vocab_size
    assert short and all(r.finish_reason == "length" and all(0 <= t < V for t in r.tokens)
                         for r in short)


def test_draft_counts_stop_where_the_row_ends(arun):
    """A same-weights draft: every draft holds. A row that ends at an end-of-sequence
    token or a stop string inside its accepted drafts counts the drafts it kept as
    tokens, not the whole verification's."""
    m, tok = tiny_model(layers=2)

    async def main():
        eng = Engine((m, tok), kv_budget=None, warmup=False,
                     draft_model=tiny_model(layers=2))
        kw = dict(chat=False, max_tokens=30, speculate="draft", num_draft=8)
        free = eng.submit(PROMPTS[0], **kw)
        res = await free
        early = res.tokens[free.drafted[2]]  # a token a draft gave
        first = res.tokens.index(early)
        eos = set(eng._exec.eos)
        eng._exec.eos = eos | {early}
        at_eos = eng.submit(PROMPTS[0], **kw)
        await at_eos
        eng._exec.eos = eos
        at_stop = eng.submit(PROMPTS[0], stop=[tok.decode([early])], **kw)
        await at_stop
        await eng.aclose()
        return res, first, at_eos, at_stop

    res, first, at_eos, at_stop = arun(main)
    assert res.draft_accepted > 3  # drafts hold (and the third lies within the row)
    for row in (at_eos, at_stop):
        assert row.finish_reason == "stop" and row.ntok <= first + 1
        assert row.draft_accepted == len(row.drafted) <= row.ntok, (row.draft_accepted,
                                                                    row.drafted, row.ntok)
        assert row.draft_proposed >= row.draft_accepted


def test_a_row_stops_drafting_when_its_acceptance_collapses():
    lk = DraftRow(0, 10)
    assert lk.k == DEFAULT_K and lk.ready()
    lk.verified(1, 1)
    assert lk.k == 2  # every draft held: twice as many
    lk.verified(2, 2)
    lk.verified(4, 4)
    assert lk.k == 8
    lk.verified(8, 2)
    assert lk.k == 3 and lk.off is None
    for _ in range(FAILS_OFF):
        lk.verified(lk.k, 0)
    assert lk.off == "acceptance collapsed" and lk.paused()
    fixed = DraftRow(3, 10)  # a user-given k: kept, never switched off
    for _ in range(10):
        fixed.verified(3, 0)
    assert fixed.off is None and fixed.k == 3


def test_bad_drafts_are_refused_with_one_line(target, arun):
    smol_vocab = tiny_model(vocab="smollm2", hidden=32, heads=2, kv_heads=1)
    cases = [dict(draft_model=smol_vocab), dict(draft_model=smol_vocab[0]),
             dict(draft_model="layers:4"), dict(draft_model="layers:0"),
             dict(draft_model=3), dict(speculate="draft")]
    errs = []
    for kw in cases:
        with pytest.raises(ValueError) as e:
            Engine(target, kv_budget=None, warmup=False, **kw)
        errs.append(str(e.value))
    assert all("\n" not in e for e in errs), errs
    assert "vocabulary differs" in errs[0] and "tokenizer" in errs[0]
    assert "vocabulary differs" in errs[1]
    assert "from 1 to 3" in errs[2] and "from 1 to 3" in errs[3]
    assert "draft_model must be" in errs[4]
    assert "needs a draft model" in errs[5]

    async def main():
        eng = Engine(target, kv_budget=None, warmup=False)
        with pytest.raises(ValueError, match="needs an engine with a draft model"):
            eng.submit("x", speculate="draft")
        await eng.aclose()

    arun(main)


def test_rows_that_end_or_are_cancelled_leave_the_draft_batch(target, arun):
    async def main():
        eng = Engine(target, kv_budget=None, warmup=False, streak_s=0,
                     draft_model="layers:2")
        base = await _tokens(eng, PROMPTS, False)
        rows = [eng.submit(p, max_tokens=N, chat=False, speculate="draft")
                for p in PROMPTS]
        short = eng.submit(PROMPTS[0], max_tokens=3, chat=False, speculate="draft")
        stopped = eng.submit(PROMPTS[1], max_tokens=N, chat=False, speculate="draft",
                             stop=["o"])
        victim = eng.submit(PROMPTS[2], max_tokens=N, chat=False, speculate="draft")
        while len(victim.tokens) < 5:
            await mlxnb.core.engine.asyncio.sleep(0.001)
        victim.cancel()
        out = [await r for r in rows]
        ends = [(await r).finish_reason for r in (short, stopped, victim)]
        await eng.aclose()
        return base, out, ends

    base, out, ends = arun(main)
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert ends[0] == "length" and ends[2] == "cancelled"


def test_a_tokenizer_of_the_same_size_but_other_ids_is_told_apart():
    from mlxnb.models.draft import vocab_mismatch

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    a = {"a": 0, "b": 1, "c": 2}
    assert vocab_mismatch(Tok(dict(a)), Tok(a)) == ""
    assert "2 of 3 tokens" in vocab_mismatch(Tok({"a": 0, "b": 2, "c": 1}), Tok(a))
    assert "4 tokens, the model's 3" in vocab_mismatch(Tok(dict(a, d=3)), Tok(a))


def test_the_kv_budget_counts_the_draft_cache(target, arun):
    """Admission under kv_budget counts a row's draft KV too: a draft of the
    target's first 2 layers adds exactly those layers' bytes per token, and the
    draft batch's real cache holds no more than that per row."""
    async def main():
        plain = Engine(target, kv_budget=None, warmup=False)
        eng = Engine(target, kv_budget=None, warmup=False, draft_model="layers:2")
        try:
            n = len(plain.layer_costs)
            assert eng.layer_costs[:n] == plain.layer_costs
            per_tok = [c[0] for c in eng.layer_costs[n:]]
            assert per_tok == [c[0] for c in plain.layer_costs[:2]] and all(per_tok)
            extra = eng.kv_bytes_for(300) - plain.kv_bytes_for(300)
            assert extra == sum(per_tok) * (300 + 512)
            rows = [eng.submit(p, max_tokens=8, chat=False, speculate="draft")
                    for p in PROMPTS[:3]]
            src = eng._exec.spec.draft
            held = []

            def peek(*_):
                if src.caches is not None and src.ids:
                    held.append((sum(c.nbytes for c in src.caches), len(src.ids),
                                 max(lk.seq_len for lk in src.rows.values())))
            while not all(r.done for r in rows):  # between ticks, while rows decode
                eng._on_worker(peek)
                await asyncio.sleep(0.005)
            assert held  # the draft batch was seen
            for nbytes, nrows, length in held:
                assert nbytes <= nrows * sum(per_tok) * (length + 512)
        finally:
            plain.close()
            eng.close()
    arun(main)
