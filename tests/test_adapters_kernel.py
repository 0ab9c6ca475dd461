"""The stacked update's GPU kernel path (lowrank_kernels.py), checked where there is
no GPU: its reference math against mlx-lm's LoRALinear row by row, the column table
the kernel indexes (a numpy copy of the kernel's loop), the self-check that guards
it, and which path an AdapterSet takes (the CPU: MLX ops, with the reason)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxnb.core.worker import lowrank, lowrank_kernels as lk
from mlxnb.core.worker.lowrank import Selection, Stacked


def emulate(y2, bmat, tab, bounds, slot, scale, B, L, out):
    """The CUDA/Metal kernel's loop, in numpy (float32 accumulation): row r's output
    columns of part p get the columns tab[p, slot of r's batch row] only."""
    y2n = np.array(y2.astype(mx.float32))
    bn = np.array(bmat.astype(mx.float32))
    tabn, bnd = np.array(tab), np.array(bounds)
    sl, sc = np.array(slot), np.array(scale).reshape(-1)
    res = np.zeros((B * L, out), np.float32)
    for r in range(B * L):
        b = r // L
        for p in range(tabn.shape[0]):
            j0, j1 = bnd[p], bnd[p + 1]
            c0, c1 = tabn[p, sl[b]]
            res[r, j0:j1] = y2n[r, j0:j1] + sc[b] * (
                y2n[r, out + c0:out + c1] @ bn[c0:c1, j0:j1])
    return mx.array(res).astype(y2.dtype).reshape(B, L, out)


def emulate_ops(y2, bmat, tab, bounds, slot, scale, B, L, out):
    """The same loop in MLX ops, so a compiled decode step can trace it: column j of
    part p adds y2's columns tab[p, slot of the row] times B_all's."""
    f32 = mx.float32
    C = y2.shape[1] - out
    j = mx.arange(out)
    part = (j[None, :] >= bounds[1:-1, None]).astype(mx.int32).sum(0)  # [out]
    cols = tab[part][:, slot]  # [out, B, 2]
    c0, c1 = cols[..., 0].T[:, None, :], cols[..., 1].T[:, None, :]  # [B, 1, out]
    c = mx.arange(C)[None, :, None]
    keep = ((c >= c0) & (c < c1)).astype(f32)  # [B, C, out]
    yb = y2.astype(f32).reshape(B, L, -1)
    u = (yb[:, :, out:, None] * (bmat[:, :out].astype(f32)[None] * keep)[:, None]).sum(2)
    return (yb[:, :, :out] + scale.reshape(B, 1, 1) * u).astype(y2.dtype)


def fused_group(seed=0, dtype=mx.float32):
    """A fused q/k-like group (two parts) over a plain linear, folded, with adapters
    of ranks 4 and 2 (the second only on part k), and the Selection of 4 rows."""
    mx.random.seed(seed)
    lin = nn.Linear(16, 12 + 6, bias=False)
    lin.set_dtype(dtype)
    a1, b1 = mx.random.normal((16, 4)), mx.random.normal((4, 12))
    a2, b2 = mx.random.normal((16, 2)), mx.random.normal((2, 6))
    a3, b3 = mx.random.normal((16, 4)), mx.random.normal((4, 6))
    blocks = [("q", "x", a1, b1), ("k", "x", a3, b3), ("k", "y", a2, b2)]
    layout = (("x", 4), ("x", 4), ("y", 2))
    base = nn.Linear(16, 18, bias=False)
    base.update(lin.parameters())
    st = Stacked([("q", 12), ("k", 6)], blocks, dtype, 0, layout, lin=lin)
    names = ["x", "y"]
    scales = {"x": 2.0, "y": 0.5}
    rows = ["x", None, "y", "x"]
    sel = Selection(rows, names, scales, False, [(layout, dtype)], fold=True)
    # mlx-lm's per row: each part's y + scale * (x @ A) @ B
    parts = {"x": [(a1, b1), (a3, b3)], "y": [None, (a2, b2)]}
    return st, sel, names, base, rows, parts, scales


def per_row(x, base, rows, parts, scales):
    out = []
    for i, a in enumerate(rows):
        y = base(x[i:i + 1])
        if a is not None:
            ups = [mx.zeros((1, x.shape[1], w)) if ab is None else
                   scales[a] * ((x[i:i + 1] @ ab[0]) @ ab[1])
                   for ab, w in zip(parts[a], (12, 6))]
            y = y + mx.concatenate(ups, axis=-1)
        out.append(y)
    return mx.concatenate(out, axis=0)


@pytest.mark.parametrize("length", [1, 3])
def test_reference_and_the_kernels_loop_match_mlx_lm_per_row(length):
    st, sel, names, base, rows, parts, scales = fused_group()
    st.use_kernel(None, names)
    x = mx.random.normal((4, length, 16))
    y2 = x.reshape(4 * length, -1) @ st.wt
    ref = lk.reference(y2, st.bpad, sel.masks[0], sel.scale_rows, 4, length, st.out)
    want = per_row(x, base, rows, parts, scales)
    assert ref.shape == (4, length, 18)
    # float32 matmuls may run as TF32 on a GPU (a 10-bit mantissa): about 3e-4 of
    # the values here, where a wrong column or row is off by their whole size
    close = dict(rtol=2e-3, atol=2e-3)
    assert mx.allclose(ref, want, **close).item()
    got = emulate(y2, st.bpad, st.tab, st.bounds, sel.slots, sel.scale_rows, 4, length,
                  st.out)
    assert mx.allclose(got, want, **close).item()
    assert mx.array_equal(got[1], y2[length:2 * length, :18]).item()  # no adapter: base


def test_table_holds_each_parts_own_columns():
    tab, bounds = lk.table({("q", "x"): (0, 4), ("k", "x"): (4, 8), ("k", "y"): (8, 10)},
                           [("q", 12), ("k", 6)], ["x", "y"])
    assert np.array(bounds).tolist() == [0, 12, 18]
    assert np.array(tab).tolist() == [[[0, 4], [0, 0], [0, 0]],
                                      [[4, 8], [8, 10], [0, 0]]]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_self_check_passes_a_right_kernel_and_names_a_wrong_one(dtype):
    def right(y2, bmat, tab, bounds, slot, scale, B, L, out):
        return emulate(y2, bmat, tab, bounds, slot, scale, B, L, out)

    def all_columns(y2, bmat, tab, bounds, slot, scale, B, L, out):
        # every adapter's columns for every row: what the table is there to prevent
        z = y2[:, out:].astype(mx.float32) @ bmat[:, :out].astype(mx.float32)
        s = mx.repeat(scale, L)[:, None]
        return (y2[:, :out].astype(mx.float32) + s * z).astype(y2.dtype).reshape(B, L, out)

    def raises(*a):
        raise RuntimeError("nvrtc: error")

    assert lk.self_check(dtype, right) is None
    assert "differs" in lk.self_check(dtype, all_columns)
    assert lk.self_check(dtype, raises) == "kernel failed: RuntimeError: nvrtc: error"
    shape = lk.self_check(dtype, lambda *a: right(*a)[:, :, :-1])
    assert shape.startswith("kernel gave")


def test_without_a_gpu_the_ops_run_with_the_reason():
    if lk.backend() is not None:
        pytest.skip("a GPU kernel API is here")
    launch, why = lk.kernel_for(mx.float32)
    assert launch is None and why == "no GPU kernel API on this device"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_on_a_gpu_the_kernel_passes_its_self_check(dtype):
    """The real kernel (CUDA or Metal) against its reference on this device."""
    if lk.backend() is None:
        pytest.skip("no GPU kernel API here")
    assert lk.status(dtype) == "kernel"


def adapter_set(monkeypatch, kernel=None, check=None):
    """A tiny model's AdapterSet with two LoRA adapters, q/k/v and gate/up fused, the
    kernel API faked as present with the numpy loop (or `check`'s verdict)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxnb.core.worker.adapters import AdapterSet
    from mlxnb.core.worker.fuse import fuse_projections
    from mlxnb.models.tiny import tiny_model

    calls = []

    def launch(*a):
        calls.append(a[-2:])  # (L, out); a decode step's once per compiled trace
        return emulate_ops(*a)

    monkeypatch.setattr(lk, "backend", lambda: "cuda")
    monkeypatch.setattr(lk, "_CHECKED", {})
    monkeypatch.setattr(lk, "_LAUNCHERS", {})
    monkeypatch.setattr(lowrank, "_KERNEL_STEPS", {})
    monkeypatch.setattr(lk, "_launch", lambda kind, *a: launch(*a))
    if check is not None:
        monkeypatch.setattr(lk, "self_check", lambda dtype, impl: check)
    model, _ = tiny_model()
    fuse_projections(model, lambda: model(mx.array([[0]]), cache=make_prompt_cache(model)))
    aset = AdapterSet(model, kernel=kernel)
    return model, aset, calls


def add_random(aset, tmp_path, names=("x", "y"), ranks=(4, 2)):
    from adapter_kit import random_adapter

    from mlxnb.models.adapters import read_adapter

    for i, (n, r) in enumerate(zip(names, ranks)):
        d = random_adapter(tmp_path / n, "lora", rank=r, scale=2.0, seed=i + 5)
        aset.add(n, read_adapter(d))


def test_an_adapter_set_runs_the_kernel_where_it_checks_out(monkeypatch, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    model, aset, calls = adapter_set(monkeypatch)
    add_random(aset, tmp_path)
    assert aset.update_path == "kernel"
    sel = aset.select(["x", None, "y"])
    ids = mx.array([[3, 4, 5], [6, 7, 8], [9, 10, 11]])
    with aset.using(sel):
        got = model(ids, cache=make_prompt_cache(model))  # prefill chunk: L = 3
        step = model(ids[:, :1], cache=make_prompt_cache(model))  # L = 1
        traced = len(calls)
        again = model(ids[:, :1], cache=make_prompt_cache(model))
    assert calls and {c[0] for c in calls} == {1, 3}
    # a decode step replays its compiled trace: no kernel call built again
    assert len(calls) == traced and mx.array_equal(again, step).item()
    # the same forwards on the ops (kernel off)
    aset.kernel = False
    aset._rebuild()
    assert aset.update_path == "ops (kernel off)"
    n = len(calls)
    with aset.using(aset.select(["x", None, "y"])):
        want = model(ids, cache=make_prompt_cache(model))
        want_step = model(ids[:, :1], cache=make_prompt_cache(model))
    assert len(calls) == n
    assert mx.allclose(got, want, atol=1e-3).item()
    assert mx.allclose(step, want_step, atol=1e-3).item()


def test_a_failed_self_check_keeps_the_ops_and_says_why(monkeypatch, tmp_path):
    model, aset, calls = adapter_set(monkeypatch, check="kernel differs from the ops by 1")
    add_random(aset, tmp_path)
    assert aset.update_path == "ops (kernel differs from the ops by 1)"
    with aset.using(aset.select(["x", "y"])):
        mx.eval(model(mx.array([[3], [4]])))
    assert not calls


def test_kernel_off_never_checks(monkeypatch, tmp_path):
    model, aset, calls = adapter_set(monkeypatch, kernel=False, check="must not be asked")
    add_random(aset, tmp_path)
    assert aset.update_path == "ops (kernel off)"


def test_the_engine_status_names_the_update_path(tmp_path):
    from adapter_kit import base_model, random_adapter

    import mlxnb

    eng = mlxnb.Engine(base_model(), warmup=False, kv_budget=None, max_batch=4)
    try:
        eng.load_adapter("x", random_adapter(tmp_path / "x", "lora", rank=4, seed=5))
        # the CPU: "update ops (no GPU kernel API on this device)"
        assert f"update {lk.status(mx.float32)}" in eng.status()
    finally:
        eng.close()


def test_the_cuda_source_compiles_where_nvcc_is(tmp_path):
    """nvcc over the kernel as MLX's cuda_kernel wraps it (its Shape type, inputs
    and template constants), for each dtype: the GPU run is the real check."""
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    for T in ("__nv_bfloat16", "__half", "float"):
        src = tmp_path / "k.cu"
        src.write_text(f"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cstdint>
using Shape = cuda::std::array<int32_t, 8>;
__global__ void k(const {T}* y2, const __grid_constant__ Shape y2_shape,
    const {T}* bmat, const __grid_constant__ Shape bmat_shape,
    const int32_t* tab, const __grid_constant__ Shape tab_shape,
    const int32_t* bounds, const uint32_t* slot, const __grid_constant__ Shape slot_shape,
    const float* scale, {T}* out) {{
  constexpr int OUT = 3072;
  constexpr int NP = 3;
  constexpr int TX = 256;
  using T = {T};
{lk._CUDA}
}}
""")
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o",
                            str(tmp_path / "k.o")], capture_output=True, text=True)
        assert r.returncode == 0, (T, r.stderr[-2000:])
