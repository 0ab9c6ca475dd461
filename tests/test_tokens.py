"""Every token-id array the engine feeds a model has one integer type
(worker/tokens.py): on CUDA each (data, index) type pair is a kernel compiled on
first use, seconds each on a fresh machine."""

import mlx.core as mx

from mlxnb import Engine
from mlxnb.core.worker.tokens import TOKEN


class _Recording:
    def __init__(self, model):
        self.model, self.seen = model, set()

    def __call__(self, x, cache=None, **kw):
        self.seen.add(x.dtype)
        return self.model(x, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_model_inputs_are_one_type_on_every_path(tiny, arun):
    model, tok = tiny
    rec = _Recording(model)

    async def main():
        eng = Engine((rec, tok), kv_budget=None, warmup=True)
        copy = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
        rows = [eng.submit("abc", chat=False, max_tokens=8),
                eng.submit("hello", chat=False, max_tokens=8, temperature=0.9, seed=3,
                           top_p=0.9, logprobs=2),
                eng.submit("xyz", chat=False, max_tokens=8, repetition_penalty=1.2),
                eng.submit(copy, chat=False, max_tokens=12, speculate="lookup")]
        await rows[0]
        late = eng.submit("a later row", chat=False, max_tokens=5, temperature=0.7)
        rows[1].cancel()
        for r in rows + [late]:
            await r
        await eng.aclose()

    arun(main)
    assert rec.seen == {TOKEN}, rec.seen


def test_sampler_rebuilds_host_arrays_on_filter():
    from mlxnb.core.worker.sampling import BatchSampler

    s = BatchSampler()
    s.extend([0.0, 0.8, 0.5], [(0, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.9, 0.0)],
             [1, 2, 3], [0, 4, 9])
    s.filter([2, 0])
    assert s._temp.tolist() == [0.5, 0.0]
    assert s._point.tolist() == [False, False]
    assert s._seeds.tolist() == [3, 1] and s.counters.tolist() == [9, 0]
    s.filter([])
    assert s.counters is None and s._seeds is None and len(s) == 0
    s.extend([0.9], [(0, 1.0, 0.0)], [2 ** 40 + 5], [1])
    assert s._seeds.tolist() == [5] and s._seeds.dtype == mx.uint32


def test_draft_speculation_feeds_both_models_one_type(tiny, arun, monkeypatch):
    model, tok = tiny
    cls = type(model)  # `layers:1` builds the draft as the same model class
    seen, call = set(), cls.__call__

    def recording(self, x, *a, **kw):
        seen.add(x.dtype)
        return call(self, x, *a, **kw)

    monkeypatch.setattr(cls, "__call__", recording)

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False, draft_model="layers:1")
        rows = [eng.submit("abcabcabcabc", chat=False, max_tokens=10, speculate="draft"),
                eng.submit("xyz", chat=False, max_tokens=6, speculate="draft",
                           temperature=0.8, seed=2)]
        for r in rows:
            await r
        assert eng.draft_proposed > 0
        await eng.aclose()

    arun(main)
    assert seen == {TOKEN}, seen
