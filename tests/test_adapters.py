"""LoRA/DoRA adapters in one batch: each row's greedy tokens equal mlx-lm's own
generation with that adapter loaded into a separate copy of the model, for LoRA and
DoRA, on a float and a 4-bit model, alone and mixed with other adapters and base
rows in one batch (one row joining mid-run); adapters trained with mlx_lm.lora too."""

import asyncio
import time

import pytest

import mlxnb
from adapter_kit import (base_model, random_adapter, reference_tokens, train_adapter,
                         write_data)

N = 20
PROMPTS = ["hello there", "the quick brown fox", "abc", "Q: what is 2 plus 3? A:",
           "mixing adapters in one batch", "x"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> directory: random LoRA (rank 4) and DoRA (rank 8), a LoRA on two
    projections of the last layer only, and a LoRA and a DoRA trained by mlx_lm.lora."""
    from mlxnb.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("adapters")
    out = {
        "rl": random_adapter(root / "rl", "lora", rank=4, scale=2.0, seed=1),
        "rd": random_adapter(root / "rd", "dora", rank=8, scale=1.5, seed=2),
        "rq": random_adapter(root / "rq", "lora", rank=8, scale=20.0, seed=3,
                             keys=["self_attn.q_proj", "mlp.down_proj"], num_layers=1),
    }
    model_dir = save_tiny_model(root / "tiny")
    data = write_data(root / "data")
    out["tl"] = train_adapter(model_dir, data, root / "tl", "lora", seed=0)
    out["td"] = train_adapter(model_dir, data, root / "td", "dora", seed=1)
    return out


@pytest.fixture(scope="module")
def refs(adapters):
    """(adapter name or None, prompt, quantized) -> mlx-lm's greedy tokens, memoized."""
    memo = {}

    def get(name, prompt, quantized):
        key = (name, prompt, quantized)
        if key not in memo:
            memo[key] = reference_tokens(adapters.get(name), prompt, N, quantized)
        return memo[key]

    return get


@pytest.fixture(params=["stacked", "gather"])
def formulation(request, monkeypatch):
    """The engine's low-rank update: the stacked one (its default) and the gathered."""
    from mlxnb.core.worker import adapters as worker_adapters

    monkeypatch.setitem(worker_adapters.DEFAULTS, "formulation", request.param)
    return request.param


def engine(quantized=False, **kw):
    kw = dict(dict(warmup=False, kv_budget=None, max_batch=16), **kw)
    return mlxnb.Engine(base_model(quantized), **kw)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4bit"])
def test_each_adapter_alone_matches_mlx_lm(adapters, refs, quantized, formulation, arun):
    async def main():
        eng = engine(quantized)
        try:
            for name, path in adapters.items():
                eng.load_adapter(name, path)
            for name in adapters:
                row = await eng.submit(PROMPTS[3], chat=False, max_tokens=N, adapter=name)
                assert row.error is None
                assert row.tokens == refs(name, PROMPTS[3], quantized), name
                # the adapter changes the output: the comparison is not base vs base
                assert row.tokens != refs(None, PROMPTS[3], quantized), name
        finally:
            await eng.aclose()

    arun(main)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4bit"])
def test_mixed_batch_with_a_joiner_matches_mlx_lm_per_row(adapters, refs, quantized,
                                                          formulation, arun):
    # three adapters (LoRA r4, DoRA r8, a LoRA on part of the model) and base rows
    # in one batch; the last row (DoRA) joins while the others decode
    plan = list(zip(PROMPTS, ["rl", None, "rd", "rq", "rl", "rd"]))
    plan += [(PROMPTS[1], "tl"), (PROMPTS[2], "td"), (PROMPTS[4], None)]
    plan.append(plan.pop(5))

    async def main():
        eng = engine(quantized)
        try:
            for name, path in adapters.items():
                eng.load_adapter(name, path)
            rows = [eng.submit(p, chat=False, max_tokens=N, adapter=a) for p, a in plan[:-1]]
            while not any(r.state == "decode" for r in rows):
                await asyncio.sleep(0.001)
            p, a = plan[-1]
            rows.append(eng.submit(p, chat=False, max_tokens=N, adapter=a))
            assert not rows[-1].done and any(r.state == "decode" for r in rows[:-1])
            res = await asyncio.gather(*rows)
            for (p, a), r in zip(plan, res):
                assert r.error is None
                assert r.tokens == refs(a, p, quantized), (a, p)
                assert r.params["adapter"] == a
        finally:
            await eng.aclose()

    arun(main)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4bit"])
def test_lora_rows_mixed_with_base_rows_match_mlx_lm(adapters, refs, quantized,
                                                     formulation, arun):
    # no DoRA row: the batch takes the stacked update's fast path at every step
    plan = [(PROMPTS[0], "rl"), (PROMPTS[1], None), (PROMPTS[2], "tl"),
            (PROMPTS[3], "rq"), (PROMPTS[4], "rl")]

    async def main():
        eng = engine(quantized)
        try:
            for name in ("rl", "rq", "tl", "rd"):
                eng.load_adapter(name, adapters[name])
            res = await asyncio.gather(*[eng.submit(p, chat=False, max_tokens=N, adapter=a)
                                         for p, a in plan])
            for (p, a), r in zip(plan, res):
                assert r.tokens == refs(a, p, quantized), (a, p)
        finally:
            await eng.aclose()

    arun(main)


def test_seeded_sampling_is_per_row_with_adapters(adapters, arun):
    async def main():
        eng = engine()
        try:
            eng.load_adapter("rd", adapters["rd"])
            kw = dict(chat=False, max_tokens=N, temperature=0.9, seed=7)
            alone = await eng.submit(PROMPTS[0], adapter="rd", **kw)
            rows = [eng.submit(PROMPTS[0], adapter=a, **kw) for a in ("rd", None, "rd")]
            res = await asyncio.gather(*rows)
            assert res[0].tokens == res[2].tokens == alone.tokens
            assert res[1].tokens != alone.tokens  # the base row under the same seed
        finally:
            await eng.aclose()

    arun(main)


def test_prefix_reuse_is_keyed_by_adapter(adapters, refs, arun):
    prompt = "a shared system prompt that is long enough to reuse"

    async def main():
        eng = engine(prefix_cache="16MB")
        try:
            eng.load_adapter("rl", adapters["rl"])
            eng.load_adapter("rd", adapters["rd"])
            first = await eng.submit(prompt, chat=False, max_tokens=N, adapter="rl")
            again = await eng.submit(prompt, chat=False, max_tokens=N, adapter="rl")
            other = await eng.submit(prompt, chat=False, max_tokens=N, adapter="rd")
            base = await eng.submit(prompt, chat=False, max_tokens=N)
            assert again.cached_tokens > 0  # same adapter: the prefix is reused
            assert other.cached_tokens == 0 and base.cached_tokens == 0
            assert first.tokens == again.tokens == refs("rl", prompt, False)
            assert other.tokens == refs("rd", prompt, False)
            assert base.tokens == refs(None, prompt, False)
            # a name unloaded and loaded again with other weights reuses nothing
            eng.unload_adapter("rl")
            eng.load_adapter("rl", adapters["rd"])
            reloaded = await eng.submit(prompt, chat=False, max_tokens=N, adapter="rl")
            assert reloaded.cached_tokens == 0
            assert reloaded.tokens == refs("rd", prompt, False)
        finally:
            await eng.aclose()

    arun(main)


def test_an_adapter_unloaded_while_a_cancelled_row_of_it_prefills(adapters, arun):
    """The cancelled row leaves its prefill group only when the group joins: its
    adapter may be gone before that, and the group's other rows go on."""
    prompt = "the same long prompt for both rows, " * 100

    async def main():
        eng = engine(prefill_chunk=16)
        try:
            eng.load_adapter("x", adapters["rl"])
            eng.load_adapter("y", adapters["rd"])
            other = eng.submit(prompt, chat=False, max_tokens=8)
            row = eng.submit(prompt + "!", chat=False, max_tokens=8, adapter="x")
            while not 0 < row.prefill_done < len(row.prompt_ids) - 64:
                assert not row.done
                await asyncio.sleep(0)
            row.cancel()
            await row
            eng.unload_adapter("x")
            return await other, row.finish_reason
        finally:
            await eng.aclose()

    other, cancelled = arun(main)
    assert cancelled == "cancelled"
    assert (other.finish_reason, other.error) == ("length", None)
    assert other.tokens == reference_tokens(None, prompt, 8)


def test_structured_rows_with_an_adapter(adapters, arun):
    async def main():
        eng = engine()
        try:
            eng.load_adapter("tl", adapters["tl"])
            row = await eng.submit("pick", chat=False, max_tokens=8, adapter="tl",
                                   choices=["yes", "no"])
            assert row.text in ("yes", "no") and row.error is None
        finally:
            await eng.aclose()

    arun(main)


def test_unload_is_refused_while_rows_use_it(adapters, formulation, arun):
    async def main():
        eng = engine()
        try:
            eng.load_adapter("rl", adapters["rl"])
            row = eng.submit(PROMPTS[0], chat=False, max_tokens=200, adapter="rl")
            with pytest.raises(ValueError, match="in use by 1 unfinished row"):
                eng.unload_adapter("rl")
            row.cancel()
            await row
            eng.unload_adapter("rl")
            assert eng.adapters == {} and eng.adapter_bytes == 0
            with pytest.raises(ValueError, match="no adapter named 'rl' is loaded"):
                eng.submit(PROMPTS[0], adapter="rl")
            # with none left the model is its own again: no wrapper in any layer
            assert "AdaptedLinear" not in repr([type(getattr(m, n, None)).__name__
                                                 for _, m in eng.model.named_modules()
                                                 for n in ("q_proj", "down_proj")])
            base = await eng.submit(PROMPTS[0], chat=False, max_tokens=N)
            assert base.tokens == reference_tokens(None, PROMPTS[0], N)
        finally:
            await eng.aclose()

    arun(main)


def test_bad_adapters_get_one_line_reasons(adapters, tmp_path):
    import json

    eng = engine()
    try:
        full = tmp_path / "full"
        full.mkdir()
        (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
        cases = [("f", full, "full fine-tune.*load it as a model"),
                 ("m", tmp_path / "missing", "no adapter directory"),
                 ("base", adapters["rl"], "'base' names the model without an adapter"),
                 ("bad name!", adapters["rl"], "short identifier"),
                 ("ft1\n", adapters["rl"], "short identifier"),
                 ("base\n", adapters["rl"], "short identifier")]
        other = tmp_path / "wide"
        import mlx.core as mx
        random_adapter(other, "lora", rank=4)
        w = mx.load(str(other / "adapters.safetensors"))
        w = {k: mx.zeros((v.shape[0] * 2, v.shape[1])) if k.endswith("lora_a") else v
             for k, v in w.items()}
        mx.save_safetensors(str(other / "adapters.safetensors"), w)
        cases.append(("w", other, "does not fit this model"))
        for name, path, msg in cases:
            with pytest.raises(ValueError, match=msg) as e:
                eng.load_adapter(name, path)
            assert "\n" not in str(e.value)
        eng.load_adapter("rl", adapters["rl"])
        with pytest.raises(ValueError, match="already loaded"):
            eng.load_adapter("rl", adapters["rd"])
        assert list(eng.adapters) == ["rl"]
    finally:
        eng.close()


def test_an_adapter_whose_stacks_outgrow_the_budget_is_refused(tmp_path):
    """The file's bytes fit, its stacks (B padded to a fused q/k/v group's width) do
    not: refused, and the engine serves on with its whole budget."""
    from mlxnb.models.adapters import read_adapter

    path = random_adapter(tmp_path / "q", "lora", rank=8, scale=2.0, seed=9,
                          keys=["self_attn.q_proj"], num_layers=2)
    budget = int(read_adapter(path).nbytes * 1.2)
    eng = engine(kv_budget=budget)
    try:
        with pytest.raises(ValueError, match="once stacked; raise kv_budget"):
            eng.load_adapter("q", path)
        assert eng.adapters == {} and eng.adapter_bytes == 0
        assert eng.scheduler.kv_budget == budget
    finally:
        eng.close()


def test_a_queued_row_the_budget_left_by_an_adapter_cannot_hold_ends_saying_so(adapters,
                                                                              arun):
    async def main():
        eng = engine(kv_budget="4MB", max_batch=1)
        try:
            need = eng.scheduler.row_bytes(40, 1024)
            eng.kv_budget = eng.scheduler.kv_budget = need + 2048  # just one such row

            def slow(tokens, logits):  # a small row that runs while the adapter loads
                time.sleep(0.02)
                return logits

            running = eng.submit("r", chat=False, max_tokens=64, logits_processors=[slow])
            queued = eng.submit("q" * 39, chat=False, max_tokens=1024)
            while running.state != "decode":
                await asyncio.sleep(0.001)
            eng.load_adapter("rd", adapters["rd"])  # takes more than the 2 kB spare
            res = await asyncio.wait_for(queued, 10)
            running.cancel()
            await running
            return res
        finally:
            await eng.aclose()

    res = arun(main)
    assert res.finish_reason == "error" and "adapters take" in res.error
    assert "raise kv_budget" in res.error


def test_adapter_bytes_count_once_against_the_kv_budget(adapters):
    eng = engine(kv_budget="64MB")
    try:
        before = eng.scheduler.kv_budget
        infos = [eng.load_adapter(n, adapters[n]) for n in ("rl", "rd", "tl")]
        # stacked over one copy of the base weights: the files' own bytes, B rows as
        # wide as a fused q/k/v or gate/up output, a DoRA magnitude row per slot;
        # nowhere near a model copy each
        model_bytes = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(
            eng.model.parameters()))
        assert 0 < eng.adapter_bytes <= 2 * sum(i.nbytes for i in infos)
        assert eng.adapter_bytes / len(infos) < 0.25 * model_bytes
        assert eng.scheduler.kv_budget == before - eng.adapter_bytes
        assert "rl (lora r4" in eng.status() and "rd (dora r8" in eng.status()
    finally:
        eng.close()


@pytest.mark.parametrize("quantized, formulation, fused, fold", [
    (False, "stacked", False, False), (False, "stacked", True, False),
    (False, "stacked", True, True), (False, "gather", False, False),
    (True, "stacked", False, False), (True, "stacked", False, True),
    (True, "gather", False, False)],
    ids=["float", "float-fused", "float-fused-fold", "float-gather", "4bit", "4bit-fold",
         "4bit-gather"])
def test_every_adapted_layer_computes_mlx_lm_per_row(adapters, quantized, formulation,
                                                     fused, fold):
    """Layer by layer, for a prefill chunk [B, L, D] and a decode step [B, 1, D]: rows
    of a mixed batch and a row alone are within float noise of mlx-lm's
    LoRALinear/DoRALinear (BLAS sums a base product of more rows, and the stacked
    formulation's products over every adapter's columns, in another order); the
    gathered formulation computes a row alone bit for bit as mlx-lm does. `fused`:
    q/k/v and gate/up fused as the engine fuses them, one update per group; `fold`:
    decode steps scale before the B product and add with one addmm."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tuner.utils import load_adapters

    from mlxnb.core.worker.adapters import AdapterSet
    from mlxnb.core.worker.fuse import fuse_projections
    from mlxnb.core.worker.lowrank import linear_dims
    from mlxnb.models.adapters import read_adapter

    names = ["rl", "rd", "rq", "td"]
    model, _ = base_model(quantized)
    if fused:
        assert fuse_projections(model, lambda: model(
            mx.array([[0]]), cache=make_prompt_cache(model))) > 0
    aset = AdapterSet(model, formulation=formulation, fold=fold)
    paths = set()
    for n in names:
        files = read_adapter(adapters[n])
        paths |= set(files.layers)
        aset.add(n, files)
    refs = {None: dict(base_model(quantized)[0].named_modules())}
    for n in names:
        ref, _ = base_model(quantized)
        load_adapters(ref, str(adapters[n]))
        refs[n] = dict(ref.named_modules())
    checked = 0
    # with DoRA rows (the DoRA path), and LoRA and base rows only (the fast path)
    for mixed, path in [(m, p) for m in (["rd", None, "rl", "rq", "td", "rd"],
                                         ["rl", None, "rq", "rl"]) for p in sorted(paths)]:
        owner_path, leaf = path.rsplit(".", 1)
        layer = getattr(dict(model.named_modules())[owner_path], leaf)
        assert type(layer).__name__ == ("_Part" if fused and leaf in (
            "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else "AdaptedLinear")
        for length in (5, 1):
            x = mx.random.normal((len(mixed), length, linear_dims(refs[None][path])[0]),
                                 key=mx.random.key(length))
            with aset.using(aset.select(mixed)):
                y = layer(x)
            for i, a in enumerate(mixed):
                want = refs[a][path](x[i:i + 1])
                with aset.using(aset.select([a])):
                    alone = layer(x[i:i + 1])
                tol = 1e-5 * max(1.0, mx.abs(want).max().item())
                if formulation == "gather":
                    assert mx.array_equal(alone, want).item(), (path, a, length)
                else:
                    assert mx.abs(alone - want).max().item() <= tol, (path, a, length)
                err = mx.abs(y[i:i + 1] - want).max().item()
                assert err <= tol, (path, a, err)
                checked += 1
    assert checked > 50
    assert aset.select([None, None]) is None  # base-only batches skip the low-rank path


@pytest.mark.parametrize("formulation", ["stacked", "gather"])
def test_removing_every_adapter_frees_their_memory(adapters, formulation):
    # the stacked update keeps A under a plain linear's own rows: removing the
    # adapters gives the linear an array of its own again, and the rows go
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxnb.core.worker.adapters import AdapterSet
    from mlxnb.core.worker.fuse import fuse_projections
    from mlxnb.models.adapters import read_adapter

    model, _ = base_model()
    fuse_projections(model, lambda: model(mx.array([[0]]), cache=make_prompt_cache(model)))
    mx.eval(model.parameters())
    gc.collect()
    before = mx.get_active_memory()
    aset = AdapterSet(model, formulation=formulation)
    for n in ("rl", "rd", "tl"):
        aset.add(n, read_adapter(adapters[n]))
    assert mx.get_active_memory() > before
    for n in ("rl", "rd", "tl"):
        aset.remove(n)
    gc.collect()
    # at most what it was: the process's other arrays (a former test's, collected
    # late) can only have gone meanwhile
    assert mx.get_active_memory() <= before
    assert aset.nbytes == 0


def test_one_engine_at_a_time_serves_adapters_on_a_model_object(adapters, refs, arun):
    # the hooks sit on the shared modules and read one engine's selection
    async def main():
        model = base_model()
        e1, e2 = (mlxnb.Engine(model, warmup=False, kv_budget=None) for _ in range(2))
        busy = "this model object already serves adapters in another Engine"
        e1.load_adapter("rl", adapters["rl"])
        with pytest.raises(ValueError, match=busy):
            e2.load_adapter("rd", adapters["rd"])
        got = [await e1.submit(PROMPTS[0], chat=False, max_tokens=N, adapter="rl"),
               await e2.submit(PROMPTS[0], chat=False, max_tokens=N)]
        e1.unload_adapter("rl")  # none left: the model is free
        e2.load_adapter("rd", adapters["rd"])
        with pytest.raises(ValueError, match=busy):
            e1.load_adapter("rl", adapters["rl"])
        got.append(await e2.submit(PROMPTS[1], chat=False, max_tokens=N, adapter="rd"))
        await e2.aclose()  # a closed engine leaves the model as it was
        e1.load_adapter("tl", adapters["tl"])
        got += [await e1.submit(PROMPTS[2], chat=False, max_tokens=N, adapter="tl"),
                await e1.submit(PROMPTS[2], chat=False, max_tokens=N)]
        await e1.aclose()
        return got

    got = arun(main)
    want = [("rl", 0), (None, 0), ("rd", 1), ("tl", 2), (None, 2)]
    assert [r.tokens for r in got] == [refs(a, PROMPTS[i], False) for a, i in want]


def test_an_engine_dropped_without_close_leaves_the_model_to_the_next(adapters, refs, arun):
    async def main():
        model = base_model()
        first = mlxnb.Engine(model, warmup=False, kv_budget=None)
        first.load_adapter("rl", adapters["rl"])
        del first  # never closed: its hooks stay on the model until the next load
        eng = mlxnb.Engine(model, warmup=False, kv_budget=None)
        eng.load_adapter("rd", adapters["rd"])
        got = [await eng.submit(PROMPTS[0], chat=False, max_tokens=N, adapter="rd"),
               await eng.submit(PROMPTS[0], chat=False, max_tokens=N)]
        await eng.aclose()
        return got

    rd, base = arun(main)
    assert rd.tokens == refs("rd", PROMPTS[0], False)
    assert base.tokens == refs(None, PROMPTS[0], False)


def test_adapters_keep_serving_after_a_failed_step(adapters, refs, arun):
    async def main():
        eng = engine()
        eng.load_adapter("rl", adapters["rl"])
        ex, real = eng._exec, eng._exec.tick

        def fails_once(*a):
            ex.tick = real
            raise RuntimeError("the device reported an error")

        ex.tick = fails_once
        failed = await eng.submit(PROMPTS[1], chat=False, max_tokens=N, adapter="rl")
        after = await eng.submit(PROMPTS[1], chat=False, max_tokens=N, adapter="rl")
        await eng.aclose()
        return failed, after

    failed, after = arun(main)
    assert failed.finish_reason == "error" and "the device reported an error" in failed.error
    assert after.tokens == refs("rl", PROMPTS[1], False)


def test_an_adapter_that_would_push_running_rows_past_the_budget_is_refused(adapters,
                                                                           arun):
    probe = engine()
    nb = probe.load_adapter("rl", adapters["rl"]) and probe.adapter_bytes
    probe.close()

    async def main():
        sizing = engine()
        need = sizing.scheduler.row_bytes(len(sizing.encode("row 0", chat=False)), 1500)
        sizing.close()
        assert nb // 2 < 2 * need  # (the adapter alone fits; with the rows it would not)
        eng = engine(kv_budget=2 * need + nb // 2)
        rows = [eng.submit(f"row {i}", chat=False, max_tokens=1500) for i in range(2)]
        while not all(r.state == "decode" for r in rows):
            await asyncio.sleep(0.001)
        with pytest.raises(ValueError, match="and the running rows' KV .* would pass the "
                                             "kv_budget .*; load it when fewer rows run"):
            eng.load_adapter("rl", adapters["rl"])
        held = eng.adapter_bytes, eng.scheduler.kv_budget == eng.kv_budget
        eng.cancel(rows)
        await asyncio.gather(*rows)
        eng.load_adapter("rl", adapters["rl"])  # with the rows gone it fits
        await eng.aclose()
        return held, rows

    (held_bytes, whole_budget), rows = arun(main)
    assert held_bytes == 0 and whole_budget  # the refused load took nothing
    assert [r.finish_reason for r in rows] == ["cancelled"] * 2


def test_unloading_one_keeps_the_others_exact(adapters, refs, formulation, arun):
    # the stacks are rebuilt without the middle slot; the rest keep their weights
    async def main():
        eng = engine()
        try:
            for n in ("rl", "rd", "tl", "td"):
                eng.load_adapter(n, adapters[n])
            eng.unload_adapter("rd")
            eng.load_adapter("rq", adapters["rq"])
            plan = [("rl", PROMPTS[0]), ("td", PROMPTS[1]), (None, PROMPTS[2]),
                    ("tl", PROMPTS[3]), ("rq", PROMPTS[4])]
            res = await asyncio.gather(*[eng.submit(p, chat=False, max_tokens=N, adapter=a)
                                         for a, p in plan])
            for (a, p), r in zip(plan, res):
                assert r.tokens == refs(a, p, False), a
        finally:
            await eng.aclose()

    arun(main)


def test_generate_keeps_each_adapters_path_for_save(adapters, arun, tmp_path):
    import json

    async def main():
        eng = engine()
        try:
            eng.load_adapter("rl", adapters["rl"])
            run = eng.generate(["abc", "xyz"], chat=False, max_tokens=4, adapter="rl")
            await run
            run.save(tmp_path / "r.jsonl")
            recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
            assert [r["adapter"] for r in recs] == ["rl", "rl"]
            assert {r["adapter_path"] for r in recs} == {str(adapters["rl"])}
        finally:
            await eng.aclose()

    arun(main)


def test_speculating_rows_keep_their_adapter(adapters, refs, arun):
    # lookup drafts are verified in a wider forward: it runs under each row's adapter
    prompt = "abcabcabcabcabcabcabc"

    async def main():
        eng = engine()
        try:
            eng.load_adapter("rl", adapters["rl"])
            eng.load_adapter("td", adapters["td"])
            rows = [eng.submit(prompt, chat=False, max_tokens=N, adapter=a,
                               speculate="lookup", num_draft=3) for a in ("rl", None, "td")]
            res = await asyncio.gather(*rows)
            for a, r in zip(("rl", None, "td"), res):
                assert r.tokens == refs(a, prompt, False), a
        finally:
            await eng.aclose()

    arun(main)


@pytest.mark.parametrize("fold", [True, False])
def test_stacked_update_of_a_linear_with_bias(fold):
    # the merged layout keeps the bias on the linear's own rows only (zeros under A)
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tuner.lora import LoRALinear

    from mlxnb.core.worker.lowrank import Selection, Stacked

    mx.random.seed(3)
    lin = nn.Linear(16, 8, bias=True)
    lin.bias = mx.random.normal((8,))
    ref = LoRALinear.from_base(nn.Linear(16, 8, bias=True), r=4, scale=3.0)
    ref.linear.update(lin.parameters())
    ref.lora_a = mx.random.normal((16, 4))
    ref.lora_b = mx.random.normal((4, 8))
    other = (mx.random.normal((16, 2)), mx.random.normal((2, 8)))
    layout = (("a", 4), ("o", 2))
    st = Stacked([("p", 8)], [("p", "a", ref.lora_a, ref.lora_b), ("p", "o", *other)],
                 mx.float32, 0, layout, lin=lin if fold else None)
    assert (st.lin is not None) == fold
    sel = Selection(["a", None, "a"], ["a", "o"], {"a": 3.0, "o": 5.0}, False,
                    [(layout, mx.float32)], fold=fold)
    base = nn.Linear(16, 8, bias=True)
    base.update(ref.linear.parameters())
    for length in (1, 3):
        x = mx.random.normal((3, length, 16))
        y = st.apply(x, sel, lin)
        assert y.shape == (3, length, 8)
        for i, want in enumerate([ref(x[0:1]), base(x[1:2]), ref(x[2:3])]):
            assert mx.allclose(y[i:i + 1], want, atol=1e-5).item(), (length, i)
    st.unmerge()
    assert lin.weight.shape == (8, 16) and lin.bias.shape == (8,)
