"""Every model family in mlx_lm.models on the engine (tiny random instances, zoo.py).

Each family either batches with greedy parity -- four prompts of different lengths
batched, the last joining mid-run, give token for token what each gives alone on a
fresh engine, and prompt 0 alone gives what mlx-lm's own generate loop gives -- or is
refused by the Engine with the one-line reason listed in REFUSED. A family whose
status changes (a refusal that starts batching, a batched family that breaks) fails
until this table says so. `python -m tests.zoo --table` prints the README's table.
"""

import pytest

from zoo import KV_WIDE, build, engine, families, reference_tokens, run_parity  # tests/ is on sys.path (pytest)

pytestmark = pytest.mark.integration  # ~140 engines: about a minute on 2 cores

# family -> the reason the Engine gives (a substring of its ValueError)
REFUSED = {
    "deepseek_v41": "its LayerCache cache has no batched form",
    "llama4": "its ChunkedKVCache cache has no batched form",
    # AFM7's KV-reuse layers take RoPE positions from the buffer length; Gemma 2
    # reshapes attention scores so a per-row mask lands on the head axis
    "afm7": "left padding reaches its attention or positions",
    "gemma2": "left padding reaches its attention or positions",
    # learned absolute positions: np.arange(cache.offset), one int for every row
    "gpt_bigcode": "a padded batch fails in its forward",
}

# family -> what goes wrong on the engine today (strict: passing again fails here).
# None: every family batches with parity or is refused. (Jamba, Mamba, Nemotron-H,
# OLMo-hybrid and Bailing-linear let right padding into their recurrent state; the
# engine measures that at load and prefills their rows unpadded.)
BROKEN = {}


@pytest.mark.parametrize("family", families())
def test_family_batches_like_alone_or_is_refused(family):
    m = build(family)  # a family that no longer builds fails here
    if not m.ok:
        pytest.skip(m.reason)
    r = run_parity(m)
    if family in REFUSED:
        assert r.status == "refused", (r.status, r.detail)
        assert REFUSED[family] in r.detail and "\n" not in r.detail
        return
    if family in BROKEN:
        assert r.status != "batched", f"{family} batches now: move it out of BROKEN"
        assert BROKEN[family] in r.detail, r.detail
        pytest.xfail(f"{r.status}: {r.detail}")
    assert r.status == "batched", f"{m.cache_kinds}: {r.status}: {r.detail}"
    assert all(len(t) > 0 for t in r.alone)
    assert r.batched == r.alone and r.reference == r.alone[0]


# Quantized KV (group 32, so twice the zoo's width): one family per kind of layer mix
KV_FAMILIES = ["llama", "gemma3", "qwen3_5", "lfm2", "falcon_h1", "recurrent_gemma",
               "gpt_oss"]
# (none: GPT-OSS's attention sinks have no quantized attention in mlx-lm, so the
# engine reads its quantized KV dequantized)
KV_REFUSED = {}
# (family, bits) -> what goes wrong on the engine today (none)
KV_BROKEN = {}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_quantized_kv_batches_like_alone(family, bits):
    m = build(family, **KV_WIDE)
    r = run_parity(m, kv_bits=bits, kv_group_size=32)
    if family in KV_REFUSED:
        assert r.status == "refused" and KV_REFUSED[family] in r.detail, r.detail
        return
    if (family, bits) in KV_BROKEN:
        assert r.status != "batched", f"{family} batches now: move it out of KV_BROKEN"
        assert KV_BROKEN[family, bits] in r.detail, r.detail
        pytest.xfail(f"{r.status}: {r.detail}")
    assert r.status == "batched", f"{m.cache_kinds}: {r.status}: {r.detail}"
    assert r.batched == r.alone
    assert r.reference == r.alone[0]


def test_tables_name_only_real_families():
    known = set(families())
    assert set(REFUSED) <= known and set(BROKEN) <= known
    assert not set(REFUSED) & set(BROKEN)
    assert set(KV_REFUSED) | {f for f, _ in KV_BROKEN} <= set(KV_FAMILIES)


# One-token prompts run no prefill forward, so their recurrent states start empty:
# padded-prefill families (Qwen3.5, Falcon-H1) and unpadded ones (Mamba, Jamba); and
# LongCat's n-gram context grows with the tokens seen, so short prompts join narrower.
@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1", "mamba", "jamba",
                                    "longcat_flash_ngram"])
def test_one_token_prompts_join_a_recurrent_batch_exactly(family):
    import asyncio

    m = build(family)
    if not m.ok:
        pytest.skip(m.reason)

    async def main():
        eng = engine(m.model)
        try:
            first = [eng.submit(p, chat=False, max_tokens=8) for p in ("a", "b", "cd")]
            await asyncio.gather(*first)
            running = eng.submit("The quick brown fox", chat=False, max_tokens=24)
            while running.state != "decode" and not running.done:
                await asyncio.sleep(0.0005)
            joined = [eng.submit(p, chat=False, max_tokens=8) for p in ("x", "y")]
            while not all(r.state == "decode" or r.done for r in joined):
                await asyncio.sleep(0.0005)
            joined.append(eng.submit("ab", chat=False, max_tokens=8))
            return await asyncio.gather(*first, running, *joined)
        finally:
            await eng.aclose()

    rows = asyncio.run(main())
    for r in rows:
        assert r.finish_reason == "length", (r.prompt, r.error)
        assert r.tokens == reference_tokens(m.model, r.prompt, len(r.tokens)), r.prompt


def test_a_model_leaking_a_little_right_padding_prefills_its_rows_unpadded():
    # Nemotron-H at this seed lets ~5e-3 of right padding into a recurrent state: a
    # float32 leak the load's padding check must catch (a shorter row prefilled next
    # to a longer one then drifted from its third token)
    import asyncio

    m = build("nemotron_h", seed=2)
    if not m.ok:
        pytest.skip(m.reason)
    prompts = ["pf,fhhaf feppkp,fnmpk.kknfln", "dcabak"]

    async def main():
        eng = engine(m.model, prefill_chunk=8)
        try:
            return await asyncio.gather(*[eng.submit(p, chat=False, max_tokens=16)
                                          for p in prompts])
        finally:
            await eng.aclose()

    for r in asyncio.run(main()):
        assert r.tokens == reference_tokens(m.model, r.prompt, 16), r.prompt


# bit counts that do not divide 32 pack D * bits / 32 words a token
@pytest.mark.parametrize("head_dim,bits,group", [(128, 6, 64), (96, 5, 32), (256, 3, 64)])
def test_kv_bits_that_do_not_divide_a_word_batch_exactly(head_dim, bits, group):
    import asyncio

    m = build("llama", head_dim=head_dim)

    async def main():
        eng = engine(m.model, kv_bits=bits, kv_group_size=group)
        try:
            return await asyncio.gather(*[eng.submit(p, chat=False, max_tokens=8)
                                          for p in ("Hi there", "a longer prompt here")])
        finally:
            await eng.aclose()

    for r in asyncio.run(main()):
        assert r.finish_reason == "length", r.error
        assert r.tokens == reference_tokens(m.model, r.prompt, 8, kv_bits=bits,
                                            kv_group_size=group), r.prompt


@pytest.mark.parametrize("family", families())
def test_the_sampling_kernels_are_compiled_for_the_models_logit_width(family):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxnb.core.worker.precompile import logit_width

    m = build(family)
    if not m.ok:
        pytest.skip(m.reason)
    logits = m.model(mx.array([[72, 105]]), cache=make_prompt_cache(m.model))
    assert logit_width(m.model) == logits.shape[-1]
