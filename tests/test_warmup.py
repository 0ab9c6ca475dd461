"""The warm-up an Engine runs at start (warmup.py): every batch path once, then no
trace of it but the shapes it has seen."""

from mlxnb import Engine
from mlxnb.core.worker.batch import BatchExecutor
from mlxnb.core.worker.warmup import _ids, warm_up


def test_warm_up_runs_every_path_and_leaves_no_trace(tiny):
    model, tok = tiny
    ex = BatchExecutor(model, tok, prefix_bytes=1 << 20)
    took = warm_up(ex)
    assert took > 0
    kinds = {k[0] for k in ex.shapes.seen}
    assert kinds == {"prefill", "decode"}
    decode = {k for k in ex.shapes.seen if k[0] == "decode"}
    # an unpadded batch (plain-cache views), a left-padded one after the join, and
    # rows leaving it (batch sizes 2 and 3)
    assert ("decode", 2, True) in decode and ("decode", 3, False) in decode
    assert any(k[0] == "prefill" and k[1] == 1 and k[4] for k in ex.shapes.seen), \
        "the joiner should prefill as a batched group (not from a reused prefix)"
    assert not ex.busy and not ex.ids and not ex.rows and ex.caches is None
    assert ex._kv_report() == (0, 0, {})
    assert ex.prefix.nbytes == 0 and ex.prefix.lookup(_ids(9, 1))[0] == 0
    assert ex.policy.step_s == ex.policy.rate_last == 0.0 and ex.nsteps == 0
    # the first budget beside running rows comes from a warm prefill measured for it
    assert ex.policy.rate > 0


def test_engine_output_is_the_same_with_and_without_warm_up(tiny, arun):
    async def run(warmup):
        eng = Engine(tiny, kv_budget=None, warmup=warmup)
        assert (eng.warmup_s > 0) == warmup
        assert eng.rows == [] and eng.steps == []
        rows = [eng.submit("abc", chat=False, max_tokens=6),
                eng.submit("hello world", chat=False, max_tokens=6, temperature=0.9,
                           seed=7, logprobs=2)]
        out = [await r for r in rows]
        await eng.aclose()
        return [(r.tokens, [round(x["logprob"], 4) for x in r.logprobs or []]) for r in out]

    assert arun(run, True) == arun(run, False)


class _FailsBatched:
    """A model whose forward raises for more than two rows at a time (the warm-up
    joins a third row; the load-time padding probe runs two)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, cache=None):
        if x.shape[0] > 2:
            raise RuntimeError("no batches here")
        return self.model(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_failing_warm_up_does_not_stop_the_engine(tiny, arun):
    model, tok = tiny

    async def main():
        eng = Engine((_FailsBatched(model), tok), kv_budget=None)
        assert eng.rows == [] and not eng.worker_state().busy
        one = await eng.submit("abc", chat=False, max_tokens=3)
        rows = [eng.submit(p, chat=False, max_tokens=3) for p in ("ab", "cd", "ef")]
        two = [await r for r in rows]
        await eng.aclose()
        return one, two

    one, two = arun(main)
    assert one.finish_reason == "length" and len(one.tokens) == 3
    assert all(r.finish_reason == "error" and "no batches here" in r.error for r in two)
