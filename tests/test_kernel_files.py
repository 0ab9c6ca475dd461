"""This package's CUDA kernels written where MLX reads compiled kernels
(core/worker/kernel_files.py). The names and sources are MLX's, so the real checks
run on a CUDA GPU: a file written under the name MLX reads, and read by a later
process (a broken file there makes MLX fail, so it read exactly that name)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from mlxnb.core.worker import kernel_files as kf

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
ROOT = Path(__file__).resolve().parent.parent


def test_std_hash_is_libstdcxx():
    # std::hash<std::string>{} of these strings, printed by a g++ (libstdc++) build
    assert kf.std_hash(b"") == 0x553e93901e462a6e
    assert kf.std_hash(b"a") == 0x454ddee488c1ed6b
    assert kf.std_hash(b"hello world") == 0x4d6686d362067ff9
    assert kf.std_hash(b"0123456789abcdef0123") == 0xec4b61c29f6a1075


class _In:
    def __init__(self, dtype, ndim):
        self.dtype, self.ndim = dtype, ndim


def test_the_source_is_built_as_mlx_builds_it():
    name, src = kf.generated(
        "k", ["x", "s"], ["y"], "y[0] = x[x_strides[0]] + s[0] * N; // x_shape",
        '#include "h.cuh"\n', [_In(mx.bfloat16, 2), _In(mx.float32, 0)], [mx.float16],
        [("T", mx.bfloat16), ("N", 3), ("F", False)])
    assert name == "custom_kernel_k_bfloat16_t_3_f"
    assert src == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        '#include "h.cuh"\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n'
        "__global__ void custom_kernel_k_bfloat16_t_3_f(\n"
        "    const __nv_bfloat16* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const __grid_constant__ Strides x_strides,\n"
        "    const float* s,\n"
        "    __half* y) {\n"
        "  using T = __nv_bfloat16;\n  constexpr int N = 3;\n  constexpr bool F = false;\n\n"
        "y[0] = x[x_strides[0]] + s[0] * N; // x_shape\n}\n\n} // namespace mlx::core::cu\n")


def test_long_module_names_become_folders(tmp_path):
    short = kf.module_file(tmp_path, "custom_kernel_k", "src")
    assert short == tmp_path / f"custom_kernel_k_{kf.std_hash(b'src'):x}.ptx"
    long = kf.module_file(tmp_path, "n" * 300, "src")
    assert long.parent == tmp_path / ("n" * 245)
    assert long.name == "n" * 55 + f"_{kf.std_hash(b'src'):x}.ptx"


def test_a_library_without_the_headers_gives_none(tmp_path):
    bogus = tmp_path / "libmlx.so"
    bogus.write_bytes(b"not an elf file")
    assert kf.device_headers(str(bogus)) == {}
    lib = next(Path(mx.__file__).parent.glob("lib/libmlx*.so*"), None)
    if lib is not None and not mx.cuda.is_available():  # the CPU build embeds none
        assert kf.device_headers(str(lib)) == {}


def test_each_new_build_is_noted_once(monkeypatch, tmp_path):
    monkeypatch.setattr(kf, "_TOOLS", [dict(folder=str(tmp_path))])
    monkeypatch.setattr(kf, "_PENDING", {})
    monkeypatch.setattr(kf, "_TIMER", [])
    monkeypatch.setattr(kf, "QUIET_S", 3600.0)
    monkeypatch.setattr(kf, "CHECKED_CALLS", 6)
    k = kf._Kernel(lambda **kw: "out", ("k", ["x"], ["y"], "y[0] = x[0];", ""))
    x = mx.zeros((2,), mx.float32)
    try:
        def call(v, dtype=mx.float32):
            return k(inputs=[x.astype(dtype)], template=[("F", v)], output_dtypes=[dtype],
                     output_shapes=[(2,)], grid=(1, 1, 1), threadgroup=(1, 1, 1))

        assert all(call(v) == "out" for v in (True, 1, True, 2))
        # a True and a 1 are two kernels (custom_kernel_k_t, custom_kernel_k_1)
        assert sorted(n for n, _ in kf._PENDING.values()) == [
            "custom_kernel_k_1", "custom_kernel_k_2", "custom_kernel_k_t"]
        # one already in the folder, or marked failed, is left to MLX
        for dtype, mark in ((mx.float16, ".ptx"), (mx.bfloat16, ".failed")):
            _, src = kf.generated("k", ["x"], ["y"], "y[0] = x[0];", "",
                                  [x.astype(dtype)], [dtype], [("F", 3)])
            kf.module_file(tmp_path, "custom_kernel_k_3", src).with_suffix(mark).touch()
            call(3, dtype)
        assert len(kf._PENDING) == 3
        call(4)  # past CHECKED_CALLS: straight to MLX
        assert len(kf._PENDING) == 3
    finally:
        for t in kf._TIMER:
            t.cancel()


def test_write_now_compiles_the_noted_builds_at_once_and_waits(monkeypatch, tmp_path):
    """own_kernels' path: every build noted so far goes to a helper of its own at
    normal priority, the quiet-time helper is called off, and the call returns when
    the helpers have (the kernels are then in MLX's folder)."""
    import json
    import subprocess

    monkeypatch.setattr(kf, "_TOOLS", [dict(folder=str(tmp_path))])
    monkeypatch.setattr(kf, "_PENDING", {})
    monkeypatch.setattr(kf, "_TIMER", [])
    monkeypatch.setattr(kf, "QUIET_S", 3600.0)
    k = kf._Kernel(lambda **kw: "out", ("k", ["x"], ["y"], "y[0] = x[0];", ""))
    x = mx.zeros((2,), mx.float32)
    for v in (1, 2, 3):
        k(inputs=[x], template=[("F", v)], output_dtypes=[mx.float32], output_shapes=[(2,)],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))
    timer = kf._TIMER[0]
    seen = []

    class Helper:
        def __init__(self, argv, **kw):
            with open(argv[-1]) as f:
                seen.append(json.load(f))
            self.waited = None

        def wait(self, timeout):
            seen.append(timeout)
            return 0

    monkeypatch.setattr(subprocess, "Popen", Helper)
    assert kf.write_now(timeout=30) == 3
    jobs, waits = seen[:3], seen[3:]
    assert all(j["threads"] == 1 and j["nice"] == 0 and len(j["jobs"]) == 1 for j in jobs)
    assert sorted(j["jobs"][0][1] for j in jobs) == [f"custom_kernel_k_{v}" for v in (1, 2, 3)]
    assert len(waits) == 3 and all(0 < w <= 30 for w in waits)
    assert kf._PENDING == {} and kf._TIMER == [] and timer.finished.is_set()
    assert kf.write_now() == 0  # nothing left: no helper
    assert len(seen) == 6


@pytest.mark.skipif(mx.cuda.is_available(), reason="the CPU and Metal path")
def test_elsewhere_the_kernel_is_mlxs_own(monkeypatch):
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or "mlx's")
    monkeypatch.setattr(kf, "_TOOLS", [])
    assert kf.cuda_kernel(name="k", input_names=["x"], output_names=["y"],
                          source="y[0] = x[0];") == "mlx's"
    assert made and made[0]["name"] == "k"


_CHILD = textwrap.dedent("""
    import sys, time
    import mlx.core as mx
    from mlxnb.core.worker import kernel_files as kf, short_conv as sc
    x, st = mx.ones((2, 1, 64), mx.bfloat16), mx.ones((2, 3, 64), mx.bfloat16)
    w = mx.ones((64, 4, 1), mx.bfloat16) / 8
    t = time.perf_counter()
    y, s2 = sc.silu_step(x, st, w)
    mx.eval(y, s2)
    print("FIRST", time.perf_counter() - t, float(y.astype(mx.float32).sum()))
    if sys.argv[1] == "wait":  # until the writer has put the file in place
        for _ in range(600):
            time.sleep(0.1)
            if not kf._PENDING and kf._TIMER and not kf._TIMER[0].is_alive():
                break
        name, src = kf.generated("mlxnb_short_conv_silu", ["x", "state_in", "w"],
                                 ["y", "state_out"], sc._BODY.replace("INPUT_HERE", sc._SILU_IN)
                                 .replace("OUTPUT_HERE", sc._SILU_OUT), sc._SILU_HEADER,
                                 [x, st, w], [mx.bfloat16] * 2,
                                 [("InT", mx.bfloat16), ("C", 64), ("L", 4)])
        path = kf.module_file(kf._toolchain()["folder"], name, src)
        for _ in range(600):
            if path.exists():
                break
            time.sleep(0.1)
        print("FILE", path)
""")


def _child(folder, arg):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    return subprocess.run([sys.executable, "-c", _CHILD, arg], env=env, capture_output=True,
                          text=True, timeout=180)


@cuda
def test_a_later_process_reads_the_kernel_the_first_one_wrote(tmp_path):
    first = _child(tmp_path, "wait")
    assert first.returncode == 0, first.stderr[-2000:]
    path = Path(first.stdout.split("FILE ")[1].strip())
    assert path.exists() and path.with_suffix(".txt").exists()
    second = _child(tmp_path, "")
    assert second.returncode == 0, second.stderr[-2000:]
    a, b = (r.stdout.split("FIRST ")[1].split() for r in (first, second))
    assert a[1] == b[1]  # the same sums
    # a broken file under that name: MLX reads it (and fails), so the name is MLX's
    path.write_bytes(b"broken")
    third = _child(tmp_path, "")
    assert third.returncode != 0 and "load" in third.stderr.lower(), third.stderr[-2000:]
