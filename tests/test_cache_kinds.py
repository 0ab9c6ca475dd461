"""Every cache kind in one batch: recurrent-state (SSM, short conv, linear attention),
sliding-window and quantized KV layers batch with greedy parity (batched == alone
== mlx-lm's own single-row generation), cancel cleanly and are counted by the KV
budget at their real size."""

import asyncio
import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache

from mlxnb import Engine
from mlxnb.core.worker.caches import make_row_cache
from mlxnb.models.tiny import byte_tokenizer

PROMPTS = ["hello there", "a much longer prompt about the sea, the sky and the rain",
           "x", "a medium length one"]

BASE = dict(vocab_size=259, hidden_size=128, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
CONFIGS = {
    # gated delta-net (linear attention) + full attention, every 2nd layer
    "qwen3_5": dict(BASE, model_type="qwen3_5", num_hidden_layers=4,
                    linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=32, linear_value_head_dim=32,
                    full_attention_interval=2),
    # short convolutions + attention
    "lfm2": dict(BASE, model_type="lfm2", num_hidden_layers=4,
                 max_position_embeddings=1024, norm_eps=1e-5, conv_bias=False,
                 conv_L_cache=3, block_dim=128, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 block_ff_dim=256,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # a pure state-space model
    "mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, vocab_size=259,
                   hidden_size=64, intermediate_size=128, state_size=16,
                   num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4,
                   n_groups=1, use_bias=False, use_conv_bias=True,
                   tie_word_embeddings=False, time_step_limit=(0.0, float("inf")),
                   time_step_rank="auto"),
    # sliding-window layers (window 8) beside a global one
    "gemma3_text": dict(BASE, model_type="gemma3_text", num_hidden_layers=3,
                        query_pre_attn_scalar=32, sliding_window=8,
                        sliding_window_pattern=3),
    "llama": dict(BASE, model_type="llama", num_hidden_layers=2),
    # per-head q/k norms (qk_rope.py)
    "qwen3": dict(BASE, model_type="qwen3", num_hidden_layers=2, rope_theta=1e6,
                  max_position_embeddings=4096),
}


def build(family: str, seed: int = 0):
    """A random-weight model of `family`, the same for the same seed whatever ran
    before: constructors draw some 1-D parameters (Qwen3.5's decay rates) from the
    global RNG, so it is seeded here (MLX has no way to put its state back)."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[family]))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if p.ndim < 2:  # norms, biases, gates, decay constants: as initialised
            new.append((name, p))
        else:
            std = 1.0 if "embed" in name else p.shape[-1] ** -0.5
            new.append((name, std * mx.random.normal(p.shape, key=k)))
    model.update(tree_unflatten(new))
    model.eval()
    mx.eval(model.parameters())
    return model


_MODELS = {}


def model_for(family):
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


def engine(family, **kw):
    kw.setdefault("kv_budget", None)
    return Engine((model_for(family), byte_tokenizer()), warmup=False, **kw)


def mlx_lm_tokens(family, ids, n, **kv):
    """mlx-lm's own single-row greedy generation from the same prompt cache kinds."""
    model = model_for(family)
    cache = make_row_cache(model, kv.get("kv_bits"), kv.get("kv_group_size", 64))
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache):
        out.append(int(tok))
    return out


CASES = [("qwen3_5", {}), ("lfm2", {}), ("mamba2", {}), ("gemma3_text", {}),
         ("llama", dict(kv_bits=4, kv_group_size=32)),
         ("llama", dict(kv_bits=8, kv_group_size=32)),
         ("qwen3_5", dict(kv_bits=4, kv_group_size=32)),
         ("gemma3_text", dict(kv_bits=8, kv_group_size=32))]


def prompts_through(model, arun, n=8, **kw):
    """(tokens, prompt ids, status line) of PROMPTS submitted together to a fresh
    Engine on `model`."""
    async def main():
        eng = Engine((model, byte_tokenizer()), warmup=False, kv_budget=None, **kw)
        rows = [eng.submit(p, max_tokens=n, chat=False) for p in PROMPTS]
        tokens = [(await r).tokens for r in rows]
        status = eng.status()
        await eng.aclose()
        return tokens, [r.prompt_ids for r in rows], status
    return arun(main)


async def alone_then_joining(eng, n):
    """(each prompt's tokens alone, their tokens when three prefill as one padded group
    and the fourth joins the running batch, the batched rows' prompt ids); closes eng."""
    alone = [(await eng.submit(p, max_tokens=n, chat=False)).tokens for p in PROMPTS]
    rows = [eng.submit(p, max_tokens=n, chat=False) for p in PROMPTS[:3]]
    while not any(r.tokens for r in rows):
        await asyncio.sleep(0.001)
    rows.append(eng.submit(PROMPTS[3], max_tokens=n, chat=False))
    batched = [(await r).tokens for r in rows]
    await eng.aclose()
    return alone, batched, [r.prompt_ids for r in rows]


@pytest.mark.parametrize("family,kv", CASES, ids=[
    f"{f}-kv{kv.get('kv_bits', 'full')}" for f, kv in CASES])
def test_greedy_parity_batched_alone_and_mlx_lm(family, kv, arun):
    n = 16
    alone, batched, ids = arun(lambda: alone_then_joining(engine(family, **kv), n))
    ids = ids[1]
    assert batched == alone
    assert len(set(map(tuple, alone))) > 1  # the prompts lead somewhere different
    assert alone[1] == mlx_lm_tokens(family, ids, n, **kv)


@pytest.mark.parametrize("family", ["mamba2", "qwen3_5", "lfm2"])
def test_rows_joining_in_padded_chunks_match_mlx_lm(family, arun):
    """A joiner's prompt is padded to the chunk's multiple and prefilled a chunk at a
    time: every chunk's recurrent state must take each row's real tokens only (mlx-lm's
    Mamba-2 attention reads the last one's decay inside the chunk)."""
    joiners = ["q" * 19, "a prompt of thirty-four characters", "x" * 45, "y" * 26]
    tok = byte_tokenizer()

    async def main():
        eng = engine(family, prefill_chunk=8, streak_s=0)
        out = []
        for text in joiners:
            running = eng.submit("the running row", chat=False, max_tokens=1000)
            while len(running.tokens) < 2:
                await asyncio.sleep(0.001)
            row = eng.submit(text, chat=False, max_tokens=6, logprobs=1)
            out.append((row.prompt_ids, await row))
            running.cancel()
            await running
        await eng.aclose()
        return out

    model = model_for(family)
    for ids, res in arun(main):
        assert len(ids) - 1 > 8 and (len(ids) - 1) % 8, len(ids)  # padded, chunked
        assert res.tokens == mlx_lm_tokens(family, list(ids), 6), tok.decode(ids)
        logits = model(mx.array([list(ids)]))[0, -1].astype(mx.float32)
        want = (logits - mx.logsumexp(logits))[res.tokens[0]].item()
        assert abs(res.logprobs[0]["logprob"] - want) < 1e-4, (want, res.logprobs[0])


def test_cancel_mid_prefill_in_a_hybrid_batch_leaves_the_others(arun):
    """Beside decoding rows a prefill advances one fixed 8-token chunk per step, so a
    long prompt is cancelled half-prefilled while the batch runs on."""
    long = "a long prompt " * 20

    async def main():
        eng = engine("qwen3_5", prefill_chunk=8)
        ref = [(await eng.submit(p, max_tokens=10, chat=False)).tokens for p in PROMPTS]
        first = eng.submit(PROMPTS[0], max_tokens=10, chat=False)
        while not first.tokens:
            await asyncio.sleep(0.0005)
        victim = eng.submit(long, max_tokens=10, chat=False)
        rows = [first] + [eng.submit(p, max_tokens=10, chat=False) for p in PROMPTS[1:]]
        while victim.prefill_done == 0:
            await asyncio.sleep(0.0005)
        victim.cancel()
        out = [(await r).tokens for r in rows]
        await victim
        await eng.aclose()
        return ref, out, victim

    ref, out, victim = arun(main)
    assert victim.finish_reason == "cancelled", victim.finish_reason
    assert 0 < victim.prefill_done < victim.prompt_tokens, victim.prefill_done
    assert out == ref


@pytest.mark.parametrize("family,kv", [("qwen3_5", {}), ("llama", dict(kv_bits=4, kv_group_size=32))])
def test_budget_counts_recurrent_state_and_quantized_bytes(family, kv, arun):
    eng0 = engine(family, **kv)
    cache = make_row_cache(eng0.model, kv.get("kv_bits"), kv.get("kv_group_size", 64),
                           eng0.quantized_attention)
    model_for(family)(mx.array([list(range(3, 40))]), cache=cache)
    mx.eval([c.state for c in cache])
    real = sum(c.nbytes for c in cache)
    fixed = sum(f for _, _, f in eng0.layer_costs)
    if family == "qwen3_5":
        assert fixed > 0 and fixed == sum(c.nbytes for c in cache if type(c) is ArraysCache)
    assert real <= eng0.kv_bytes_for(37)
    eng0.close()
    one_row = eng0.kv_bytes_for(max(map(len, PROMPTS)) + 2 + 24)
    budget = int(2.5 * one_row)

    async def main():
        eng = engine(family, kv_budget=budget, **kv)
        run = eng.generate(PROMPTS * 3, max_tokens=24, chat=False)
        most = 0
        while not run.done:
            most = max(most, eng.running)
            await asyncio.sleep(0.001)
        res = await run
        await eng.aclose()
        return eng.steps, res, most

    steps, res, most = arun(main)
    assert all(r.finish_reason in ("length", "stop") for r in res)
    assert 1 <= most <= 2  # the budget, not max_batch, limits the batch
    assert max(s.kv_bytes for s in steps) <= budget


def test_prefix_reuse_of_quantized_kv_keeps_outputs(arun):
    """A reused prefix of quantized KV is the same triplets the prompt would
    quantize again, so rows read the same logprobs as on an engine without reuse."""
    header = "You are a helpful assistant. Answer briefly. " * 2
    kv = dict(kv_bits=8, kv_group_size=32)

    async def one(eng, prompt):
        return await eng.submit(header + prompt, chat=False, max_tokens=10, logprobs=1)

    async def main():
        eng = engine("llama", **kv)
        cold = engine("llama", prefix_cache=None, **kv)
        a = await one(eng, "first")
        b = await one(eng, "second")
        busy = eng.generate(["x", "yy"], max_tokens=40, chat=False)  # a hit beside these
        c = await one(eng, "second!")
        await busy
        refs = [await one(cold, p) for p in ("second", "second!")]
        several = ["a", "bb", "ccc"]  # hits that join the batch together
        together = await eng.generate([header + p for p in several], chat=False,
                                      max_tokens=10, logprobs=1)
        together_refs = [await one(cold, p) for p in several]
        status = eng.status()
        await eng.aclose()
        await cold.aclose()
        return a, b, c, refs, status, together, together_refs

    a, b, c, (ref_b, ref_c), status, together, together_refs = arun(main)
    assert all(r.cached_tokens >= len(header) for r in together)
    assert "prefix reuse on" in status
    assert a.cached_tokens == 0 and b.cached_tokens >= len(header)
    assert c.cached_tokens >= len(header) + len("second") - 1
    for got, ref in [(b, ref_b), (c, ref_c)] + list(zip(together, together_refs)):
        assert got.tokens == ref.tokens
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3
                   for x, y in zip(got.logprobs, ref.logprobs))


def test_quantized_kv_holds_fewer_bytes_than_full():
    full = engine("llama", kv_budget=None)
    q4 = engine("llama", kv_budget=None, kv_bits=4, kv_group_size=32)
    ratio = full.kv_bytes_for(2048) / q4.kv_bytes_for(2048)
    full.close(), q4.close()
    assert ratio > 3.5  # float32 KV here; 4-bit with group 32: 32 / 4.5 bits


def test_status_names_the_cache_kinds():
    eng = engine("qwen3_5", kv_bits=8, kv_group_size=32)
    s = eng.status()
    eng.close()
    assert "2 recurrent-state + 2 attention layers, KV 8-bit" in s
    assert "prefix reuse off for these cache kinds" in s


def test_bad_kv_options_are_one_line_errors():
    for kw, word in [(dict(kv_bits=7), "kv_bits"), (dict(kv_group_size=48), "kv_group_size")]:
        with pytest.raises(ValueError, match=word) as e:
            engine("llama", **kw)
        assert "\n" not in str(e.value)
    from mlxnb.models.tiny import tiny_model

    with pytest.raises(ValueError, match="kv_group_size=128") as e:  # head dim 16
        Engine(tiny_model(), warmup=False, kv_bits=4, kv_group_size=128)
    assert "\n" not in str(e.value)


def test_mlxnb_load_kv_bits_and_config(monkeypatch, arun, capsys):
    import sys
    import types

    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from mlxnb.notebook import magics
    from mlxnb.models.tiny import tiny_model

    pair = tiny_model(hidden=128)  # head dim 32
    monkeypatch.setitem(sys.modules, "mlxnb.models.loading",
                        types.SimpleNamespace(load_model=lambda name: pair))
    ip = InteractiveShell.instance()
    magics.load_ipython_extension(ip)

    async def main():
        try:
            ip.run_line_magic("mlxnb", "load tiny --kv-bits 4 --kv-group-size 32")
            assert magics.get_engine().kv_bits == 4
            ip.run_line_magic("mlxnb", "status")
            for bad, word in [("--kv-bits 7", "kv_bits"), ("--kv-bits four", "--kv-bits"),
                              ("--kv-bits 4 --kv-group-size 100", "kv_group_size")]:
                with pytest.raises(UsageError, match=word) as e:
                    ip.run_line_magic("mlxnb", f"load tiny {bad}")
                assert "\n" not in str(e.value)
            assert magics.get_engine().kv_bits == 4  # a failed load keeps the engine
            ip.run_line_magic("config", "MLXNB.kv_bits = 8")
            ip.run_line_magic("config", "MLXNB.kv_group_size = 32")
            ip.run_line_magic("mlxnb", "load tiny --max-batch 4")
            assert magics.get_engine().kv_bits == 8
            ip.run_line_magic("mlxnb", "load tiny --kv-bits none")
            assert magics.get_engine().kv_bits is None
        finally:
            await magics.shutdown()

    try:
        arun(main)
    finally:
        magics.unload_ipython_extension(ip)
        magics._S.config = None
        ip.config.pop("MLXNB", None)
    assert "attention layers, KV 4-bit" in capsys.readouterr().out


def test_kv_dequantized_for_attention_where_quantized_matmul_is_missing(monkeypatch, arun):
    """A device without quantized matmuls for attention's shapes (MLX's CUDA backend)
    gets the same quantized storage, read back dequantized: same bytes, parity."""
    def missing(*a, **k):
        raise ValueError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(mx, "quantized_matmul", missing)
    kv = dict(kv_bits=4, kv_group_size=32)

    async def main():
        eng = engine("gemma3_text", **kv)
        alone = [(await eng.submit(p, max_tokens=12, chat=False)).tokens for p in PROMPTS]
        batched = [r.tokens for r in await eng.generate(PROMPTS, max_tokens=12, chat=False)]
        status, costs = eng.status(), eng.layer_costs
        await eng.aclose()
        return alone, batched, status, costs

    alone, batched, status, costs = arun(main)
    assert batched == alone
    assert "KV 4-bit (dequantized for attention on this device: no quantized matmul" in status
    monkeypatch.undo()
    q = engine("gemma3_text", **kv)
    assert q.quantized_attention and q.layer_costs == costs
    q.close()


@pytest.mark.parametrize("kind", ["full", "quantized"])
def test_a_prefill_groups_right_padding_becomes_left_padding_in_order(kind):
    """finalize: row b's tokens move from [0, n_b) to [pad_b, width), in order, and
    its left padding grows by its right padding, for plain and quantized KV."""
    from mlxnb.core.worker.caches import LeanBatchKVCache
    from mlxnb.core.worker.quantized_kv import BatchQuantizedKVCache

    B, H, D, lengths = 3, 2, 64, [5, 8, 2]
    width = max(lengths)
    pads = [width - n for n in lengths]
    c = (LeanBatchKVCache([0] * B) if kind == "full"
         else BatchQuantizedKVCache([0] * B, 64, 8))
    c.prepare(lengths=lengths, right_padding=pads)
    pos = 10 * mx.arange(B)[:, None, None, None] + mx.arange(width)[None, None, :, None]
    keys = mx.broadcast_to(pos.astype(mx.float32), (B, H, width, D))
    c.update_and_fetch(keys, -keys)
    c.finalize()
    assert c.left_padding.tolist() == pads
    if kind == "full":
        k, v = c.keys, c.values
    else:
        k = mx.dequantize(*c.keys, group_size=64, bits=8)
        v = mx.dequantize(*c.values, group_size=64, bits=8)
    for b in range(B):
        want = (10 * b + mx.arange(lengths[b]))[None, :, None]
        got_k, got_v = k[b, :, pads[b]:width, :], v[b, :, pads[b]:width, :]
        assert mx.allclose(got_k, want, atol=0.5).item(), got_k[0, :, 0]
        assert mx.allclose(got_v, -want, atol=0.5).item()
