"""calls_ahead.py: the load's compiled-function calls, found in forwards that are never
evaluated and replayed in helper processes (on the CPU, which keeps no kernels, the
replays run and write nothing)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxnb.core.worker import calls_ahead, kernels_ahead
from mlxnb.core.worker.caches import make_row_cache
from mlxnb.core.worker.loadchecks import load_forwards
from procs import imported_by_main  # tests/ is on sys.path (pytest)
from zoo import build


@pytest.fixture(scope="module")
def hybrid():
    return build("qwen3_5").model


def survey(model):
    return calls_ahead.survey(load_forwards(model, lambda: make_row_cache(model),
                                            list(range(3, 20))))


def names(groups):
    return sorted((g[0]["module"], g[0]["name"]) for g in groups)


def test_a_hybrids_load_forwards_reach_its_gated_delta_rule(hybrid):
    groups = survey(hybrid)
    found = names(groups)
    for fn in ("compute_g", "_gated_delta_step_ops"):
        assert ("mlx_lm.models.gated_delta", fn) in found
    # the step with and without the padding mask: two groups, two sets of kernels
    steps = [g for g in groups if g[0]["name"] == "_gated_delta_step_ops"]
    masks = sorted(json.dumps(g[0]["args"][-1] if len(g[0]["args"]) > 6 else
                              g[0]["kwargs"].get("mask")) for g in steps)
    assert len(steps) == 2 and any('"bool"' in m for m in masks), masks
    # each group's calls differ only in sizes
    for g in groups:
        assert len({json.dumps(calls_ahead._what(c, sizes=False)) for c in g}) == 1


def test_the_survey_puts_every_function_back(hybrid):
    before = [(m, a, f) for m, a, f in calls_ahead._bindings()]
    assert any(f is nn.silu for _, _, f in before)
    survey(hybrid)
    after = calls_ahead._bindings()
    assert [(m, a) for m, a, _ in before] == [(m, a) for m, a, _ in after]
    assert all(f is g for (_, _, f), (_, _, g) in zip(before, after))


def test_a_replay_makes_the_calls_it_was_made_from(hybrid):
    # zeros of the recorded shapes and dtypes, and the same constants: recorded
    # again, the replay's calls are the survey's, which is what names MLX's kernels
    for group in survey(hybrid):
        for inline in (False, True):
            with calls_ahead.recording() as again:
                calls_ahead.replay(group, inline)
            assert [c for g in calls_ahead.grouped(again) for c in g] == group


def test_a_nested_call_is_left_to_the_outer_one(monkeypatch):
    mod = types.ModuleType("mlx_lm.models._nested_probe")
    mod.outer = mx.compile(lambda x: nn.silu(x) * 2)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with calls_ahead.recording() as calls:
        mod.outer(mx.zeros((2, 3)))
        nn.silu(mx.zeros((4,), mx.float16))
    assert [(c["name"], c["args"][0]["d"]) for c in calls] == [
        ("outer", "float32"), ("silu", "float16")]


def test_calls_another_load_compiled_are_left_out(hybrid, tmp_path):
    # a model sharing some calls with one loaded before (a swiglu at the same
    # dtypes) starts helpers for the rest only
    groups = survey(hybrid)
    first = calls_ahead.pieces(groups)
    done = {n for p in first[:2] for n in calls_ahead.done_names(p)}
    left = calls_ahead.pieces(groups, done.__contains__)
    assert len(left) == len(first) - 2 and left == first[2:]
    one = json.loads(first[2])
    marked = calls_ahead.done_names(first[2])[:1]
    part = calls_ahead.pieces(groups, set(done | set(marked)).__contains__)
    assert json.loads(part[0])["calls"] == one["calls"][1:]


def test_the_functions_come_back_when_a_forward_raises():
    before = calls_ahead._bindings()
    with pytest.raises(RuntimeError):
        with calls_ahead.recording():
            assert not isinstance(nn.silu, calls_ahead._COMPILED)  # (the recorder)
            raise RuntimeError("a forward failed")
    assert [(m, a, id(f)) for m, a, f in calls_ahead._bindings()] == [
        (m, a, id(f)) for m, a, f in before]


def test_other_threads_pass_through_the_recorder():
    import threading

    with calls_ahead.recording() as calls:
        t = threading.Thread(target=lambda: mx.eval(nn.silu(mx.zeros((7, 3), mx.float16))))
        t.start()
        t.join()
        nn.silu(mx.zeros((2,)))
    assert [c["args"][0]["a"] for c in calls] == [[2]]


def test_a_failing_forward_leaves_the_probes_to_say_why():
    def bad():
        nn.silu(mx.zeros((3,)))
        raise ValueError("this model cannot run")

    assert names(calls_ahead.survey([bad, lambda: pytest.fail("ran on")])) == [
        ("mlx.nn.layers.activations", "silu")]


def test_calls_that_cannot_be_made_again_are_not_recorded(monkeypatch):
    mod = types.ModuleType("mlx_lm.models._dict_probe")
    mod.fn = mx.compile(lambda d: d["x"] + 1)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with calls_ahead.recording() as calls:
        assert mod.fn({"x": mx.zeros((2,))}).tolist() == [1.0, 1.0]  # (still runs)
    assert calls == []


def test_the_engine_compiles_the_surveyed_calls_ahead_once(hybrid, tmp_path, monkeypatch):
    # a helper process per group beside the fixed pieces; each marks its calls done
    from mlxnb.models.tiny import byte_tokenizer

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernels_ahead, "wanted", lambda: True)
    ahead = kernels_ahead.ModelKernels.for_model(hybrid, byte_tokenizer())
    assert ahead.start()
    calls = [p for p in ahead.pieces if calls_ahead.is_piece(p)]
    # each group as it is and inlined in a fixed-shape compile (the decode steps')
    assert len(calls) == 2 * len(survey(hybrid)) >= 10
    procs = list(ahead.procs)
    ahead.wait(timeout=120)
    assert [p.returncode for p in procs] == [0] * len(procs)
    done = sorted(f.name for f in (tmp_path / "ptx").glob("mlxnb-model-call-*.done"))
    assert done == sorted(n for p in calls for n in calls_ahead.done_names(p))
    assert len(set(done)) == sum(len(json.loads(p)["calls"]) for p in calls)
    again = kernels_ahead.ModelKernels.for_model(hybrid, byte_tokenizer())
    assert not again.start() and again.missing() == []


def test_no_survey_where_no_kernels_are_kept(hybrid, monkeypatch):
    monkeypatch.setattr(kernels_ahead, "wanted", lambda: False)
    monkeypatch.setattr(calls_ahead, "survey", lambda f: pytest.fail("surveyed"))
    assert kernels_ahead.ModelKernels.for_model(hybrid, None).missing() == []


def test_a_replay_imports_no_more_of_mlx_lm_than_its_models(hybrid):
    group = next(g for g in survey(hybrid) if g[0]["name"] == "compute_g")
    assert imported_by_main("mlxnb.core.worker.kernels_ahead",
                            [calls_ahead.pieces([group])[1], "bfloat16"],
                            ("transformers",)) == []


_KERNELS = r'''
import glob, os, sys
import mlxnb
from mlxnb.core.worker import calls_ahead
from mlxnb.core.worker.caches import make_row_cache
from mlxnb.core.worker.loadchecks import load_forwards
from bench.cache_kinds import build_hybrid

model, tokenizer, _ = build_hybrid("qwen3_5-0.8b", "bfloat16", "quick")  # dense MLPs
if sys.argv[1] == "replay":
    groups = calls_ahead.survey(load_forwards(model, lambda: make_row_cache(model),
                                              list(range(3, 20))))
    for piece in calls_ahead.pieces(groups):
        calls_ahead.run_piece(piece)
else:
    mlxnb.Engine((model, tokenizer), warmup=False, kv_budget=None).close()
names = {os.path.basename(f).split("_contiguous")[0].split("_strided")[0]
         for f in glob.glob(os.path.join(os.environ["TMPDIR"], "mlx", "*", "cpu", "*.cpp"))}
print("\n".join(sorted(names)))
'''


@pytest.mark.integration
def test_the_replays_compile_kernels_the_engines_load_runs(tmp_path):
    # MLX's CPU backend names its fused kernels as the CUDA backend does and keeps
    # their source under $TMPDIR: a fresh folder each shows what a process compiled
    def kernels(mode):
        tmp = tmp_path / mode
        tmp.mkdir()
        out = subprocess.run([sys.executable, "-c", _KERNELS, mode], capture_output=True,
                             text=True, timeout=600, cwd=str(Path(__file__).parents[1]),
                             env=dict(os.environ, TMPDIR=str(tmp)))
        assert out.returncode == 0, out.stderr[-2000:]
        return set(out.stdout.split())

    replayed, loaded = kernels("replay"), kernels("engine")
    assert len(replayed) >= 8
    # nothing compiled in vain, but for one that only CUDA's load runs: the gated
    # norm's float32 swish (mlx-lm's precise_swiglu) in a fixed-shape compile, which
    # on the CPU the decode step fuses with the norm itself
    assert all("f4ISigmoid" in k for k in replayed - loaded), replayed - loaded
    assert len(replayed - loaded) <= 1
    # what the load compiled beyond them: the sampler's kernels (precompile.py's
    # helpers) and, on the CPU, the decode step's fused norms, which CUDA runs as
    # this package's kernels (gated_delta.py). (Ops outside any compiled function
    # that a decode step fuses, as a MoE block's shared-expert gate, are left to
    # the load.)
    left = [k for k in loaded - replayed if not ("u4" in k or "Select" in k or "Divide" in k
                                                 or "Rsqrt" in k)]
    assert left == []
