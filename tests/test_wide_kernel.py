"""worker/wide_kernel.py: which verification attention reaches the kernel, that the
engine uses it on CUDA only once its self-check on the device passes and not where
the user opted out, and that its CUDA source compiles. The kernel runs only on CUDA; here a stand-in
with its contract (causal attention of W positions over S keys) records what reaches
it."""

import asyncio
import shutil
import subprocess

import mlx.core as mx
import pytest

from mlxnb import Engine
from mlxnb.core.worker import kv_attention as ka
from mlxnb.core.worker import wide_kernel, wideattn
from mlxnb.models.tiny import tiny_model


def _contract(q, k, v, scale, mask="causal"):
    """What the kernel computes, by MLX: position w sees keys up to S - W + w, or
    those a boolean mask [B, 1, W, S] allows."""
    return wideattn._fused(q, k, v, scale=scale, mask=mask)


@pytest.fixture
def kernel_on(monkeypatch):
    calls = []
    monkeypatch.setattr(wide_kernel, "dense_wide",
                        lambda q, k, v, scale, mask="causal":
                        calls.append((q.shape, isinstance(mask, str)))
                        or _contract(q, k, v, scale, mask))
    wideattn.use_kernel(True)
    yield calls
    wideattn.use_kernel(False)


def test_causal_half_precision_verifications_take_the_kernel(kernel_on):
    B, Hq, Hkv, S, D = 1, 6, 2, 30, 64
    k, v = (mx.random.normal((B, Hkv, S, D)).astype(mx.bfloat16) for _ in range(2))
    q = {W: mx.random.normal((B, Hq, W, D)).astype(mx.bfloat16)
         for W in (1, 3, wide_kernel.MAX_POSITIONS, wide_kernel.MAX_POSITIONS + 1)}
    padded = mx.arange(S)[None, None, None] >= mx.array([4])[:, None, None, None]
    padded = padded & (mx.arange(S) <= (mx.arange(3) + S - 3)[:, None])  # [B, 1, 3, S]
    with wideattn.wide_attention():
        got = mx.fast.scaled_dot_product_attention(q[3], k, v, scale=0.125, mask="causal")
        got_padded = mx.fast.scaled_dot_product_attention(q[3], k, v, scale=0.125, mask=padded)
        for W, mask in ((1, None), (wide_kernel.MAX_POSITIONS, "causal"),
                        (wide_kernel.MAX_POSITIONS + 1, "causal"), (3, None),
                        (3, padded.astype(mx.float32)),
                        (3, mx.broadcast_to(padded, (B, Hq, 3, S)))):
            mx.fast.scaled_dot_product_attention(q[W], k, v, scale=0.125, mask=mask)
        mx.fast.scaled_dot_product_attention(q[3].astype(mx.float32), k.astype(mx.float32),
                                             v.astype(mx.float32), scale=0.125, mask="causal")
    # one position keeps MLX's kernel; unmasked, too wide, a float or a per-head
    # mask: composed
    assert kernel_on == [((B, Hq, 3, D), True), ((B, Hq, 3, D), False),
                         ((B, Hq, wide_kernel.MAX_POSITIONS, D), True)]
    assert mx.array_equal(got, _contract(q[3], k, v, 0.125)).item()
    assert mx.array_equal(got_padded, _contract(q[3], k, v, 0.125, padded)).item()


def test_wide_supports_only_what_the_kernel_computes():
    k = mx.zeros((1, 2, 40, 64), mx.bfloat16)
    assert ka.wide_supports((1, 6, 5, 64), k, "causal", 0.125)
    assert not ka.wide_supports((1, 6, 5, 64), k, None, 0.125)  # no mask: all keys
    assert ka.wide_supports((1, 6, 5, 64), k, mx.ones((1, 1, 5, 40), mx.bool_), 0.125)
    assert not ka.wide_supports((1, 6, 5, 64), k, mx.ones((1, 1, 5, 40)), 0.125)  # additive
    assert not ka.wide_supports((2, 6, 5, 64), k, mx.ones((1, 1, 5, 40), mx.bool_), 0.125)
    assert not ka.wide_supports((1, 6, 5, 64), k, mx.ones((1, 1, 1, 40), mx.bool_), 0.125)
    assert not ka.wide_supports((1, 6, 5, 64), k, mx.ones((1, 6, 5, 40), mx.bool_), 0.125)
    assert not ka.wide_supports((1, 6, 1, 64), k, "causal", 0.125)
    assert not ka.wide_supports((1, 6, 17, 64), k, "causal", 0.125)
    assert not ka.wide_supports((1, 5, 5, 64), k, "causal", 0.125)  # heads not grouped
    assert not ka.wide_supports((1, 6, 5, 512), mx.zeros((1, 2, 40, 512)), "causal", 0.1)


def _generate(arun, model, tok, prompts, engine_speculates=True):
    async def run():
        eng = Engine((model, tok), kv_budget=None, warmup=False,
                     speculate="lookup" if engine_speculates else None)
        # submitted together: the rows share steps, their verifications left-padded,
        # until the first ends and the last goes on alone
        rows = [eng.submit(p, chat=False, max_tokens=24 * (i + 1), speculate="lookup",
                           num_draft=4) for i, p in enumerate(prompts)]
        for r in rows:
            await r
        status = eng.cache_kinds
        await eng.aclose()
        return [r.tokens for r in rows], status

    return arun(run)


def _bf16_model(seed):
    model, tok = tiny_model(seed=seed, hidden=128, heads=4)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())  # here: the engine's worker thread has its own stream
    return model, tok


PROMPTS = ["abc abc abc abc the cat", "hello world hello world hello"]


def test_the_engine_verifies_through_the_kernel_on_cuda_once_checked(
        arun, monkeypatch, kernel_on):
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_dense_cuda", lambda q, k, v, scale, mask:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    checked = []
    monkeypatch.setattr(ka, "self_check_wide", lambda calls: checked.append(calls) or None)
    from mlxnb.core.worker.caches import LeanBatchKVCache
    try:
        monkeypatch.setenv("MLXNB_WIDE_ATTENTION", "composed")
        plain, status = _generate(arun, *_bf16_model(3), PROMPTS)
        assert "verification attention" not in status and not kernel_on and not checked
        monkeypatch.delenv("MLXNB_WIDE_ATTENTION")
        got, status = _generate(arun, *_bf16_model(3), PROMPTS)
    finally:
        LeanBatchKVCache.dense_decode = False
        wideattn.use_kernel(False)
    assert "verification attention: fused kernel" in status
    assert checked and checked[0]  # the model's attention shapes were checked
    assert got == plain
    assert kernel_on and all(2 <= s[2] <= wide_kernel.MAX_POSITIONS for s, _ in kernel_on)
    assert {causal for _, causal in kernel_on} == {True, False}  # alone and padded


def test_every_width_runs_in_a_capacity_the_check_loads(monkeypatch):
    """A width's kernel is its capacity's, and the load check reaches every capacity
    (so no width compiles or loads a kernel mid-run), part-full ones included."""
    assert [wide_kernel.capacity(W) for W in range(2, 17)] == [2, 4, 4] + [8] * 4 + [16] * 8
    assert {wide_kernel.capacity(W) for W in ka.WIDE_CHECK_WIDTHS} == set(wide_kernel.CAPACITIES)
    assert any(W < wide_kernel.capacity(W) for W in ka.WIDE_CHECK_WIDTHS)
    seen = []
    monkeypatch.setattr(wide_kernel, "dense_wide", lambda q, k, v, scale, mask:
                        seen.append((q.shape[2], isinstance(mask, str)))
                        or _contract(q, k, v, scale, mask))
    assert ka.self_check_wide([(6, 2, 64, mx.bfloat16, mx.bfloat16, 0.125)]) is None
    assert seen == [(W, causal) for W in ka.WIDE_CHECK_WIDTHS for causal in (True, False)]


def test_an_engine_that_does_not_speculate_by_default_compiles_no_kernel(
        arun, monkeypatch, kernel_on):
    """Its rows may still ask to speculate: they verify with the composed attention,
    and the load never compiles (checks) the kernel."""
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_dense_cuda", lambda q, k, v, scale, mask:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    checked = []
    monkeypatch.setattr(ka, "self_check_wide", lambda calls: checked.append(calls) or None)
    monkeypatch.delenv("MLXNB_WIDE_ATTENTION", raising=False)
    from mlxnb.core.worker.caches import LeanBatchKVCache
    try:
        got, status = _generate(arun, *_bf16_model(3), PROMPTS, engine_speculates=False)
        reached = list(kernel_on)
        want, on = _generate(arun, *_bf16_model(3), PROMPTS)
    finally:
        LeanBatchKVCache.dense_decode = False
        wideattn.use_kernel(False)
    assert "verification attention: composed (Engine(speculate=...)" in status
    assert len(checked) == 1 and "verification attention: fused kernel" in on
    assert reached == [] and kernel_on  # only the second engine's verifications
    assert got == want


def test_a_failed_self_check_keeps_the_composed_attention(arun, monkeypatch):
    shapes = [(6, 2, 64, mx.bfloat16, mx.bfloat16, 0.125)]
    monkeypatch.setattr(wide_kernel, "dense_wide", _contract)
    assert ka.self_check_wide(shapes) is None  # the contract passes its check
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_dense_cuda", lambda q, k, v, scale, mask:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    monkeypatch.setattr(wide_kernel, "dense_wide", lambda q, k, v, scale, mask: q * 0)
    monkeypatch.delenv("MLXNB_WIDE_ATTENTION", raising=False)
    from mlxnb.core.worker.caches import LeanBatchKVCache
    try:
        _, status = _generate(arun, *_bf16_model(3), PROMPTS[:1])
    finally:
        LeanBatchKVCache.dense_decode = False
    assert "verification attention: composed (wide kernel differs" in status
    assert not wideattn._kernel["on"]


def test_the_cuda_source_compiles_where_nvcc_is(tmp_path):
    """nvcc over the kernel as MLX's cuda_kernel wraps it (its Shape and Strides
    types, inputs in order, template constants), for the extremes of dtype, head
    size and position capacity: the GPU run (the self-check) is the real check."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")

    def wrap(i, T, D, WQ, warps, masked):
        args = [f"const {T}* queries", "const __grid_constant__ Shape queries_shape",
                "const __grid_constant__ Strides queries_strides",
                f"const {T}* kd", "const __grid_constant__ Shape kd_shape",
                "const __grid_constant__ Strides kd_strides",
                f"const {T}* vd", "const __grid_constant__ Strides vd_strides"]
        if masked:
            args += ["const bool* mask", "const __grid_constant__ Strides mask_strides"]
        consts = "".join(f"  constexpr int {n} = {x};\n" for n, x in (
            ("D", D), ("NREP", 3), ("RPB", 1), ("WARPS", warps), ("U", 1), ("WQ", WQ),
            ("LK", wide_kernel.kk.dense_lanes(D)), ("SCALE_BITS", 1040187392)))
        return (f"__global__ void k{i}({', '.join(args + [f'{T}* out'])}) {{\n"
                f"  using T = {T};\n  using TK = {T};\n{consts}"
                f"{wide_kernel.source(masked)}\n}}\n")

    assert wide_kernel.CAPACITIES == (2, 4, 8, 16)
    cases = [("__nv_bfloat16", 64, 2, 8), ("__half", 96, 8, 8),
             ("float", 128, wide_kernel.MAX_POSITIONS,
              wide_kernel.warps_for(128, wide_kernel.MAX_POSITIONS))]
    src = tmp_path / "k.cu"
    src.write_text("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
                   "#include <cuda/std/array>\n#include <cuda/std/limits>\n"
                   "#include <cstdint>\nusing Shape = cuda::std::array<int32_t, 8>;\n"
                   "using Strides = cuda::std::array<int64_t, 8>;\n"
                   + "".join(wrap(2 * i + m, *c, bool(m)) for i, c in enumerate(cases)
                           for m in (0, 1)))
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o",
                        str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
