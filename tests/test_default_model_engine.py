"""The engine on the real bundled model (SmolLM2-135M-Instruct): a few end-to-end checks."""

import asyncio

import pytest

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is the capital of France?",
    "Name five fruits.",
    "What color is the sky on a clear day?",
    "Write one sentence about cats.",
]


@pytest.fixture(scope="module")
def default_pair():
    import mlxnb

    return mlxnb.load_model("default")


def test_default_model_answers_and_batches_like_alone(default_pair, arun):
    async def main():
        from mlxnb import Engine

        eng = Engine(default_pair, kv_budget="1GB")
        solo = [await eng.submit(q, max_tokens=24) for q in QUESTIONS]
        first = eng.generate(QUESTIONS[:2], max_tokens=24)
        await asyncio.sleep(0.3)  # the others join a running batch
        second = eng.generate(QUESTIONS[2:], max_tokens=24)
        batched = list(await first) + list(await second)
        await eng.aclose()
        return solo, batched, eng.steps

    solo, batched, steps = arun(main, timeout=300)
    assert "Paris" in solo[0].text
    agree = sum(a.tokens == b.tokens for a, b in zip(solo, batched))
    # f32 on CPU: batched and alone are the same computation row by row.
    assert agree == len(QUESTIONS), [(a.text, b.text) for a, b in zip(solo, batched)]
    assert max(s.batch_size for s in steps) >= 3


def test_default_model_seeded_sampling_reproducible_in_batch(default_pair, arun):
    kw = dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=11)

    async def main():
        from mlxnb import Engine

        eng = Engine(default_pair, kv_budget="1GB")
        a = await eng.submit(QUESTIONS[1], **kw)
        rows = [eng.submit(q, **kw) for q in QUESTIONS]
        b = (await asyncio.gather(*rows))[1]
        await eng.aclose()
        return a, b

    a, b = arun(main, timeout=300)
    assert a.tokens == b.tokens and a.text == b.text


def test_default_model_speculates_on_a_copy_task_with_the_same_tokens(default_pair, arun):
    text = ("The Harbor Street library opened on 12 March 1921 with four thousand books "
            "and one reading room.")
    prompt = f"Repeat the following text exactly, word for word:\n\n{text}"

    async def main():
        from mlxnb import Engine

        eng = Engine(default_pair, kv_budget="1GB")
        off = await eng.submit(prompt, max_tokens=24)
        on = await eng.submit(prompt, max_tokens=24, speculate="lookup", num_draft=4)
        await eng.aclose()
        return off, on

    off, on = arun(main, timeout=300)
    assert on.tokens == off.tokens
    assert on.draft_accepted > 0.5 * on.draft_proposed > 0  # the copy is drafted


def test_default_model_layer_skip_draft_keeps_tokens_and_drafts(default_pair, arun):
    """The model's own first 20 layers as its draft (a fixed draft length: every
    step verifies): the same tokens as without it, alone and beside another row."""
    async def main():
        from mlxnb import Engine

        eng = Engine(default_pair, kv_budget="1GB", draft_model="layers:20")
        off = [await eng.submit(q, max_tokens=16) for q in QUESTIONS[:2]]
        rows = [eng.submit(q, max_tokens=16, speculate="draft", num_draft=2)
                for q in QUESTIONS[:2]]
        on = [await r for r in rows]
        status = eng.status()
        await eng.aclose()
        return off, on, status

    off, on, status = arun(main, timeout=300)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert all(r.draft_proposed >= 10 for r in on)
    assert "draft layers:20" in status
