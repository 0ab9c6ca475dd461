"""worker/rows_gemv.py: which linears take the few-row GEMV kernel, and that nothing
changes where its check fails. The kernel itself runs only on CUDA; here a stand-in
with the kernel's contract (each row's product as MLX forms it for one row) records
what reaches it."""

import asyncio

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxnb import Engine
from mlxnb.core.worker import rows_gemv
from mlxnb.models.tiny import tiny_model


def test_on_this_cpu_the_model_is_left_alone(monkeypatch):
    model, _ = tiny_model(seed=1)
    assert rows_gemv.check([(64, 64)], mx.float32) == "not a CUDA device"
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "off")
    assert rows_gemv.install(model) == "MLX's matmul (MLXNB_ROWS_GEMV=off)"
    for form in ("gather", ""):  # "": unset, the default (gathered, verifications)
        monkeypatch.setenv("MLXNB_ROWS_GEMV", form)
        assert rows_gemv.install(model) == "MLX's matmul (not a CUDA device)"
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "1")
    assert rows_gemv.install(model) == "MLX's matmul (not a CUDA device)"
    assert not any(type(m) is rows_gemv.RowsLinear for _, m in model.named_modules())


class StandIn(list):
    """The row counts the stand-in kernel was given outside the load check."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.mp, self.checking = monkeypatch, False

    def device(self, cuda: bool):
        """Whether install finds a CUDA device (for engines made from now on)."""
        self.mp.setattr(rows_gemv, "_backend_ok", lambda: None if cuda else "off")


@pytest.fixture
def stand_in(monkeypatch):
    """The kernel's contract on the CPU: each row's product as MLX forms it alone."""
    calls = StandIn(monkeypatch)
    check = rows_gemv.check

    def matmul(x, w):
        if not calls.checking:
            calls.append(x.shape[0])
        return mx.concatenate([x[i:i + 1] @ w.T for i in range(x.shape[0])])

    def checked(*a):
        calls.checking = True
        try:
            return check(*a)
        finally:
            calls.checking = False

    calls.device(True)
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "1")
    monkeypatch.setattr(rows_gemv, "matmul", matmul)
    monkeypatch.setattr(rows_gemv, "check", checked)
    monkeypatch.setitem(rows_gemv._STATE, "on", False)
    return calls


def _generate(arun, model, tok, prompts, **kw):
    async def run():
        eng = Engine((model, tok), kv_budget=None)
        rows = await asyncio.gather(*[eng.submit(p, chat=False, max_tokens=12, **kw)
                                      for p in prompts])
        await eng.aclose()
        return [r.tokens for r in rows]

    return arun(run)


def test_batched_rows_take_the_kernel_and_decode_the_same(arun, stand_in):
    prompts = ["hello there", "the cat sat", "one two three"]
    stand_in.device(False)
    plain = _generate(arun, *tiny_model(seed=2), prompts)
    stand_in.device(True)
    model, tok = tiny_model(seed=2)
    got = _generate(arun, model, tok, prompts)
    assert got == plain
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is rows_gemv.RowsLinear for m in linears)
    # three rows decoding (and fewer as they end); never one row or a prefill
    assert 3 in stand_in and all(2 <= M <= rows_gemv.MAX_ROWS for M in stand_in)


def test_verification_positions_take_the_kernel(arun, stand_in):
    text = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta "
    stand_in.device(False)
    plain = _generate(arun, *tiny_model(seed=2), [text], speculate=None)
    stand_in.device(True)
    model, tok = tiny_model(seed=2)
    spec = _generate(arun, model, tok, [text], speculate="lookup", num_draft=4)
    assert spec == plain
    assert any(M > 1 for M in stand_in)


def test_verify_mode_gives_the_kernel_verifications_only(arun, stand_in, monkeypatch):
    """MLXNB_ROWS_GEMV=verify: rows decoding side by side keep MLX's matmul; the
    positions of a verification take the kernel; tokens as without it."""
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "verify")
    prompts = ["hello there", "the cat sat", "one two three"]
    stand_in.device(False)
    plain = _generate(arun, *tiny_model(seed=2), prompts)
    stand_in.device(True)
    assert _generate(arun, *tiny_model(seed=2), prompts) == plain
    assert not stand_in  # three rows decoding, no verification: nothing reached it
    text = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta "
    stand_in.device(False)
    plain = _generate(arun, *tiny_model(seed=2), [text], speculate=None)
    stand_in.device(True)
    model, tok = tiny_model(seed=2)
    assert rows_gemv.install(tiny_model(seed=2)[0]).endswith(", verifications only")
    spec = _generate(arun, model, tok, [text], speculate="lookup", num_draft=4)
    assert spec == plain
    assert stand_in and all(2 <= M <= rows_gemv.MAX_ROWS for M in stand_in)


def test_a_kernel_that_differs_by_a_bit_is_not_used(monkeypatch, stand_in):
    def off(x, w):
        return mx.concatenate([x[i:i + 1] @ w.T for i in range(x.shape[0])]) * 1.001

    monkeypatch.setattr(rows_gemv, "matmul", off)
    model, _ = tiny_model(seed=1)
    note = rows_gemv.install(model)
    assert note.startswith("MLX's matmul (rows differ from MLX's one-row products")
    assert not rows_gemv._STATE["on"]
    assert not any(type(m) is rows_gemv.RowsLinear for _, m in model.named_modules())


def test_biased_and_quantized_linears_keep_mlx(stand_in):
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=True),
                          nn.QuantizedLinear(64, 64, bias=False))
    assert rows_gemv.install(model) == "kernel, 1 layers"
    kinds = [type(m) for m in model.layers]
    assert kinds == [rows_gemv.RowsLinear, nn.Linear, nn.QuantizedLinear]
    stand_in.clear()
    mx.eval(model(mx.zeros((4, 64))))
    assert stand_in == [4]  # the first layer only
    stand_in.clear()
    mx.eval(model(mx.zeros((rows_gemv.MAX_ROWS + 1, 64))), model(mx.zeros((1, 64))))
    assert stand_in == []


def test_only_the_installing_thread_takes_the_products(stand_in):
    """The compiled products are called on one thread only (MLX keeps traces per
    thread: test_recurrent's test of other callers says why): another thread's
    forward of the same model runs nn.Linear's product."""
    from concurrent.futures import ThreadPoolExecutor

    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    assert rows_gemv.install(model) == "kernel, 1 layers"
    mx.eval(model.parameters())
    stand_in.clear()

    def forward():
        with mx.stream(mx.new_stream(mx.default_device())):  # (streams are per thread)
            mx.eval(model(mx.zeros((4, 64))))

    with ThreadPoolExecutor(1) as other:
        other.submit(forward).result()
    assert stand_in == []
    mx.eval(model(mx.zeros((4, 64))))
    assert stand_in == [4]


def test_the_gathered_gemv_is_each_rows_own_product():
    """The gather form's product: row i of x times w.T, for any row count (MLX's
    gather_mm runs here on the CPU in float32; on CUDA `check` asks bit equality)."""
    key = mx.random.key(3)
    w = mx.random.normal((96, 64), key=key)
    for M in (2, 3, 17):
        x = mx.random.normal((M, 64), key=mx.random.split(key)[M % 2])
        want = mx.concatenate([x[i:i + 1] @ w.T for i in range(M)])
        assert mx.allclose(rows_gemv.gathered(x, w), want, atol=1e-5).item()


@pytest.fixture
def gather_spy(monkeypatch):
    """MLXNB_ROWS_GEMV=gather on a stand-in CUDA device: the real gathered product
    (float32 on this CPU), its row counts recorded outside the load check."""
    calls, real, check = [], rows_gemv.gathered, rows_gemv.check
    state = {"checking": False}

    def spy(x, w):
        if not state["checking"]:
            calls.append(x.shape[0])
        return real(x, w)

    def checked(*a):
        state["checking"] = True
        try:
            return check(*a)
        finally:
            state["checking"] = False

    monkeypatch.setattr(rows_gemv, "_backend_ok", lambda: None)
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "gather")
    monkeypatch.setattr(rows_gemv, "gathered", spy)
    monkeypatch.setattr(rows_gemv, "check", checked)
    monkeypatch.setitem(rows_gemv._STATE, "on", False)
    return calls


@pytest.mark.parametrize("setting", ["gather", None])  # None: unset, the default
def test_the_gathered_gemv_takes_its_products_with_the_same_tokens(arun, gather_spy,
                                                                  monkeypatch, setting):
    """`gather`: rows decoding side by side and verification positions take it;
    the default: verification positions only. Tokens as with MLX's matmul."""
    prompts = ["hello there", "the cat sat", "one two three"]
    text = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta "
    monkeypatch.setenv("MLXNB_ROWS_GEMV", "off")
    plain = _generate(arun, *tiny_model(seed=2), prompts)
    plain_one = _generate(arun, *tiny_model(seed=2), [text], speculate=None)
    if setting is None:
        monkeypatch.delenv("MLXNB_ROWS_GEMV")
    else:
        monkeypatch.setenv("MLXNB_ROWS_GEMV", setting)
    note = rows_gemv.install(tiny_model(seed=2)[0])
    assert note.startswith("gathered GEMV, ")
    assert note.endswith(", verifications only") == (setting is None)
    assert not gather_spy
    assert _generate(arun, *tiny_model(seed=2), prompts) == plain
    if setting is None:
        assert not gather_spy  # three rows decoding side by side keep MLX's matmul
    else:
        assert 3 in gather_spy
        assert all(2 <= M <= rows_gemv.GATHER_MAX_ROWS for M in gather_spy)
    gather_spy.clear()
    assert _generate(arun, *tiny_model(seed=2), [text], speculate="lookup",
                     num_draft=4) == plain_one
    assert any(M > 1 for M in gather_spy)  # a lone row's verification positions


def test_a_gathered_gemv_that_differs_by_a_bit_is_not_used(monkeypatch, gather_spy):
    monkeypatch.setattr(rows_gemv, "gathered", lambda x, w: (x @ w.T) * 1.001)
    model, _ = tiny_model(seed=1)
    assert rows_gemv.install(model).startswith(
        "MLX's matmul (rows differ from MLX's one-row products")
    assert not any(type(m) is rows_gemv.RowsLinear for _, m in model.named_modules())


def test_hybrid_mlps_still_compile_over_kernel_linears(stand_in):
    from test_cache_kinds import build  # tests/ is on sys.path (pytest)
    from mlxnb.core.worker.setup import BatchModel

    tok = tiny_model(seed=0)[1]
    stand_in.device(False)
    plain = BatchModel(build("qwen3_5", seed=4), tok)
    assert plain.linears == "MLX's matmul (off)"
    stand_in.device(True)
    setup = BatchModel(build("qwen3_5", seed=4), tok)
    assert setup.linears.startswith("kernel")
    assert setup.compiled_layers == plain.compiled_layers > 0


def test_the_cuda_source_compiles_where_nvcc_is(tmp_path):
    """nvcc over the kernel as MLX's cuda_kernel wraps it (its Shape type, inputs and
    template constants), for the extremes of dtype, vector width and row capacity: the GPU run
    (bench verify-cost, the load check) is the real check."""
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    body = "\n".join(f"""
__global__ void k{i}(const {T}* x, const __grid_constant__ Shape x_shape, const {T}* w,
                     const __grid_constant__ Shape w_shape, {T}* out) {{
  using T = {T};
  constexpr int NPT = {npt};
  constexpr int K = {K};
  constexpr int N = {N};
  constexpr int MAXM = {m};
  constexpr int WARPS = {rows_gemv.WARPS};
{rows_gemv._BODY}
}}"""
        for i, (T, npt, m, K, N) in enumerate(
            (T, npt, m, K, N) for T in ("__nv_bfloat16", "float")
            for npt, K, N in ((1, 72, 40), (4, 2048, 8192))
            for m in (rows_gemv.BUCKETS[0], rows_gemv.BUCKETS[-1])))
    src = tmp_path / "k.cu"
    src.write_text(f"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cstdint>
{rows_gemv._HEADER}
namespace cg = cooperative_groups;
using Shape = cuda::std::array<int32_t, 8>;
{body}
""")
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o",
                        str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("N,K", [(576, 1536), (3584, 1024), (2048, 8192), (49152, 576)])
def test_every_row_count_routed_to_the_kernel_has_a_compiled_and_checked_capacity(
        N, K, monkeypatch):
    monkeypatch.setitem(rows_gemv._STATE, "form", "kernel")
    # the layer routes M rows when 2 <= M <= MAX_ROWS and M*N*K <= MAX_WORK; each such
    # M must land in a capacity whose kernel check compiles and covers at both ends
    routed = [M for M in range(2, rows_gemv.MAX_ROWS + 1) if M * N * K <= rows_gemv.MAX_WORK]
    caps = rows_gemv.buckets(N, K)
    checked = rows_gemv._check_rows(N, K)
    assert sorted({next(b for b in rows_gemv.BUCKETS if M <= b) for M in routed}) == caps
    for b in caps:
        inside = [M for M in routed if M <= b and M > max([c for c in caps if c < b], default=1)]
        assert min(inside) in checked and max(inside) in checked
    assert all(M in routed for M in checked)
    assert (bool(routed) == bool(caps)
            == ((N, K) in {(N2, K2) for N2, K2 in [(576, 1536), (3584, 1024), (2048, 8192)]}))


@pytest.mark.parametrize("N,K", [(576, 1536), (3584, 1024), (2048, 8192), (49152, 576)])
def test_the_gathered_gemvs_check_covers_its_fewest_and_most_rows(N, K, monkeypatch):
    monkeypatch.setitem(rows_gemv._STATE, "form", "gather")
    routed = [M for M in range(2, rows_gemv.GATHER_MAX_ROWS + 1)
              if M * N * K <= rows_gemv.MAX_WORK]
    checked = rows_gemv._check_rows(N, K)
    assert set(checked) <= set(routed)
    if routed:
        assert min(routed) in checked and max(routed) in checked
    assert bool(routed) == (N * K * 2 <= rows_gemv.MAX_WORK)
