"""Sampling kernels compiled in helper processes (worker/precompile.py) and the
kernel cache's folder (models/kernel_cache.py)."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxnb.core.worker import precompile, sampling
from mlxnb.core.worker.sampling import BatchSampler


def _draws(fused: bool, B=64, V=4096, steps=20):
    sampling.use_fused(fused)
    try:
        s = BatchSampler()
        s.extend([0.5 + i / B for i in range(B)], [(0, 1.0, 0.0)] * B, list(range(B)), [0] * B)
        out = []
        for step in range(steps):
            logits = mx.random.normal((B, V), key=mx.random.key(step)) * 4
            out.append(s.sample(logits))
        return mx.stack(out).tolist()
    finally:
        sampling.use_fused(True)


def test_unfused_draws_the_same_tokens():
    # the engine switches from one to the other mid-run when the fused kernel lands
    assert _draws(False) == _draws(True)


def test_move_places_names_before_code_and_keeps_existing(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("a", "b", "c"):
        (src / f"{name}.ptx").write_text(f"ptx {name}")
        (src / f"{name}.txt").write_text(f"names {name}")
    (src / "d.ptx").write_text("a kernel still being written: no names yet")
    long = src / ("F" * 200) / "G"  # a name too long for one file name
    long.mkdir(parents=True)
    (long / "e.ptx").write_text("ptx e")
    (long / "e.txt").write_text("names e")
    (dst / "b.ptx").write_text("compiled here")
    (dst / "b.txt").write_text("names here")
    order = []
    real = os.replace
    try:
        os.replace = lambda a, b: (order.append(os.path.basename(b)), real(a, b))
        assert precompile._move_kernels(src, dst) == 6
    finally:
        os.replace = real
    assert order == ["e.txt", "e.ptx", "a.txt", "a.ptx", "c.txt", "c.ptx"]
    assert (dst / ("F" * 200) / "G" / "e.ptx").read_text() == "ptx e"
    assert (dst / "b.ptx").read_text() == "compiled here"
    assert not (dst / "d.ptx").exists()
    assert sorted(p.name for p in dst.iterdir()) == ["F" * 200, "a.ptx", "a.txt", "b.ptx",
                                                      "b.txt", "c.ptx", "c.txt"]


@pytest.mark.parametrize("piece", precompile.PIECES)
def test_each_piece_runs_in_its_own_process(piece):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "mlxnb.core.worker.precompile", piece, "512"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_compilers_run_then_sampling_is_fused_again(tmp_path, monkeypatch):
    cache = tmp_path / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    monkeypatch.setattr(precompile, "PIECES", ("gumbel", "top_k"))
    p = precompile.Precompiler(512)
    assert p.start() and p.pending
    assert sampling._gumbel_argmax is sampling._gumbel_argmax_unfused
    for proc in p.procs:
        proc.wait(timeout=120)
    p.poll()
    assert not p.pending and p.took is not None
    assert sampling._gumbel_argmax is sampling._gumbel_argmax_fused
    assert (cache / "mlxnb-sampling-512.done").exists()
    assert [f.name for f in tmp_path.iterdir()] == ["ptx"]  # the private folder is gone
    # on disk already: nothing starts again
    assert not precompile.Precompiler(512).start()


_WAIT = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)"


def gated_spawn(root, gate, waits):
    """compilers.spawn's contract (a private folder, one process per piece), each
    piece leaving `<piece>.ptx` and `.txt` in its folder; processes of the pieces
    where `waits(piece)` run until `gate` exists, the others exit at once."""
    from mlxnb.core.worker.compilers import piece_folder

    def spawn(module, pieces, arg, what):
        private = root / f"private-{what}"
        private.mkdir()
        procs = []
        for i, piece in enumerate(pieces):
            folder = piece_folder(private, i)
            folder.mkdir()
            (folder / f"{piece}.ptx").write_text("ptx")
            (folder / f"{piece}.txt").write_text("names")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _WAIT if waits(piece) else "pass", str(gate)],
                stderr=subprocess.PIPE))
        return private, procs

    return spawn


def test_each_pieces_kernels_land_as_soon_as_it_exits(tmp_path, monkeypatch):
    """The other pieces' kernels reach MLX's folder while the slow fused Gumbel piece
    still compiles: a top-k row's unfused draw then finds its filter on disk."""
    cache, gate = tmp_path / "ptx", tmp_path / "gumbel-done"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    monkeypatch.setattr(precompile, "spawn", gated_spawn(
        tmp_path, gate, lambda piece: piece == "gumbel"))
    p = precompile.Precompiler(512)
    assert p.start()
    try:
        for proc, piece in zip(p.procs, p.pieces):
            if piece != "gumbel":
                proc.wait(timeout=60)
        p.poll()
        landed = sorted(f.stem for f in cache.glob("*.ptx"))
        assert landed == sorted(x for x in precompile.PIECES if x != "gumbel")
        assert p.pending and sampling._gumbel_argmax is sampling._gumbel_argmax_unfused
        gate.touch()
        p.procs[p.pieces.index("gumbel")].wait(timeout=60)
        p.poll()
    finally:
        p.close()
    assert sorted(f.stem for f in cache.glob("*.ptx")) == sorted(precompile.PIECES)
    assert sampling._gumbel_argmax is sampling._gumbel_argmax_fused
    assert (cache / "mlxnb-sampling-512.done").exists()


def test_close_stops_the_compilers(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    p = precompile.Precompiler(512)
    assert p.start()
    procs = list(p.procs)
    p.close()
    assert all(proc.returncode is not None for proc in procs)
    assert sampling._gumbel_argmax is sampling._gumbel_argmax_fused
    assert not (tmp_path / "ptx" / "mlxnb-sampling-512.done").exists()


def test_kernel_cache_goes_to_the_user_cache_unless_chosen(tmp_path):
    code = "import mlxnb, os; print(os.environ.get('MLX_PTX_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["MLXNB_CACHE"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60).stdout.strip()
    assert out.startswith(str(tmp_path / "mlx-")) and out.endswith("ptx")
    env["MLX_PTX_CACHE_DIR"] = "/somewhere/chosen"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60).stdout.strip()
    assert out == "/somewhere/chosen"


def test_the_kernel_folder_is_named_by_the_gpus_model(tmp_path, monkeypatch):
    from mlxnb.models import kernel_cache

    monkeypatch.setattr(kernel_cache, "GPUS", tmp_path)
    assert kernel_cache.gpu_models() == []  # no NVIDIA driver: one folder, "ptx"
    for i, model in enumerate(["NVIDIA H200", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"]):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
        (tmp_path / f"0000:0{i}:00.0" / "information").write_text(
            f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-1\n")
    assert kernel_cache.gpu_models() == ["nvidia-a100-sxm4-80gb", "nvidia-h200"]


def test_model_kernel_pieces_run_and_mark_their_dtype_done(tmp_path, monkeypatch):
    # every piece's snippet runs (here on the CPU, which writes no kernels); the
    # engine waits for them once per machine and dtype
    from mlxnb.core.worker import kernels_ahead
    from mlxnb.models.tiny import tiny_model

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernels_ahead, "wanted", lambda: True)
    dtype = kernels_ahead.model_dtype(tiny_model()[0])
    assert dtype == "float32"
    ahead = kernels_ahead.ModelKernels("bfloat16")
    ahead.wanted.append("state_rows")  # (what a model with recurrent states adds)
    assert ahead.start()
    procs = list(ahead.procs)
    assert len(procs) == len(kernels_ahead.PIECES) + 1
    ahead.wait(timeout=120)
    assert [p.returncode for p in procs] == [0] * len(procs)
    for piece in kernels_ahead.PIECES + ("state_rows",):
        assert (tmp_path / "ptx" / f"mlxnb-model-kernels-bfloat16-{piece}.done").exists()
    assert ahead.private is None and not ahead.procs
    assert not kernels_ahead.ModelKernels("bfloat16").start()  # done: nothing to run
    assert not kernels_ahead.ModelKernels(None).start()


def test_a_model_with_recurrent_states_compiles_their_row_filter_ahead():
    from zoo import build  # tests/ is on sys.path (pytest)

    from mlxnb.core.worker.kernels_ahead import ModelKernels
    from mlxnb.models.tiny import byte_tokenizer

    for family, states in (("qwen3_5", True), ("lfm2", True), ("llama", False)):
        ahead = ModelKernels.for_model(build(family).model, byte_tokenizer())
        assert ("state_rows" in ahead.wanted) is states, family


def test_a_compiler_process_imports_no_more_of_mlx_lm_than_sample_utils():
    """The compilers start at once on a fresh machine: importing mlx-lm's package (and
    with it transformers: some 10 s on a fresh GPU host) in each would come before any
    kernel compiles. The piece still runs mlx-lm's own top-k filter."""
    from procs import imported_by_main  # tests/ is on sys.path (pytest)

    assert imported_by_main("mlxnb.core.worker.precompile", ["top_k", "512"],
                            ("mlx_lm", "transformers")) == ["mlx_lm", "mlx_lm.sample_utils"]


def test_a_compile_outlives_the_engine_that_started_it(tiny, arun, tmp_path, monkeypatch):
    """An engine closed mid-compile (a re-run cell, a benchmark's rounds) leaves the
    compile to the process: the next engine goes on with it, never starts it over."""
    from mlxnb import Engine

    cache, gate = tmp_path / "ptx", tmp_path / "all-done"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    monkeypatch.setattr(precompile, "spawn", gated_spawn(tmp_path, gate, lambda piece: True))
    monkeypatch.setattr(precompile, "_SHARED", {})
    p = precompile.for_vocab(tiny[0].args.vocab_size)
    try:
        async def one_engine():
            eng = Engine(tiny, kv_budget=None, warmup=False)
            row = await eng.submit("x", chat=False, max_tokens=2)
            await eng.aclose()
            return row

        assert arun(one_engine).finish_reason == "length"
        procs = list(p.procs)
        assert procs and all(proc.poll() is None for proc in procs)  # still compiling
        assert arun(one_engine).finish_reason == "length"
        assert p.procs == procs  # the same compile, not a new one
        gate.touch()
        assert p.wait(60)
    finally:
        p.close()
    assert sampling._gumbel_argmax is sampling._gumbel_argmax_fused
    assert (cache / f"mlxnb-sampling-{tiny[0].args.vocab_size}.done").exists()


def test_a_wrapped_model_compiles_for_its_logit_width(monkeypatch):
    """Qwen3.5 keeps its vocabulary size in `args.text_config`: the sampling kernels
    are compiled for the logits the model gives, not for an empty vocabulary."""
    from bench.cache_kinds import build_hybrid

    model, tok, vocab = build_hybrid("qwen3_5-0.8b", "float32", "quick")
    assert getattr(model.args, "vocab_size", None) is None
    assert precompile.logit_width(model) == vocab == model(mx.array([[3, 4]])).shape[-1]
    seen = []
    monkeypatch.setattr(precompile, "for_vocab", lambda v: seen.append(v) or
                        precompile.Precompiler(v))
    from mlxnb.core.worker.batch import BatchExecutor

    BatchExecutor(model, tok).close()
    assert seen == [vocab]


def test_no_compiler_starts_for_an_unknown_vocabulary(monkeypatch):
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    monkeypatch.setattr(precompile, "spawn", lambda *a: pytest.fail("spawned"))
    assert not precompile.Precompiler(0).start()
