"""A linear layer's product for a few rows as one GEMV per layer, on CUDA.

MLX's CUDA backend runs `x @ W.T` as its GEMV kernel only for one row; from two rows
on it calls cuBLAS, which on an H200 costs 15-25 us a call for a [2..16, 576] @ [576,
1536] product against 6-8 us for one row (`bench verify-cost`). A decode step of a few
rows, and a verification forward of a row's drafts, are such products on every
projection of every layer, and the weights they read are a few MB: the time is launch
and set-up, not bandwidth. Two forms give each of M rows its own GEMV:

* "gather" (the default): MLX's own gathered GEMV. `gathered` is one `mx.gather_mm`
  of the rows as [M, 1, K] against the weight's transposed view, which MLX's CUDA
  backend launches as `gemv_gather`: every row through the same `gemv_impl` as its
  one-row GEMV. No compile; the host builds it in 4-6 us against a matmul's 1.5-2.5,
  and each row reads the weight (from L2 where it fits). On an H200: 10-18 us for 3-32
  rows of SmolLM2's products against cuBLAS's 15-23, and a verification forward of 5-8
  positions 5.0 ms of device time against 7.6
  (bench/results/verify-cost-2026-12-04-h200.md).
* "kernel": this module's CUDA kernel, MLX's GEMV given M rows (each warp reads one
  output's weight row once and keeps M sums). Its sizes are template constants (one
  kernel per layer shape and row capacity, 2, 4, 8 or 16 rows): NVRTC takes seconds
  a kernel, and MLX keeps no custom kernel on disk (kernels_ahead.py), so `install`'s
  check compiles them in every process that turns it on, about a minute on a fresh
  H200 host (bench/results/verify-cost-2026-12-03-h200.md,
  first-token-2026-12-03-h200.md).

Either way a row's sum is formed exactly as MLX's one-row GEMV forms it (the same
elements per lane in the same order, the same vector width, cooperative groups' warp
reduction), so a row's product has the same bits alone, beside other rows, or as one
position of a verification: `check` asserts that on this device before any layer uses
the form, and `install` leaves the model untouched where it does not hold (or where
there is no CUDA: the CPU, Metal).

Which products take it (MLXNB_ROWS_GEMV): by default those of verification forwards
(`verifying`), which is where it measured a gain: copy-heavy speculation at B=1 on
H200 hosts ran at 1.75-1.90x with it and 1.64-1.71x without
(bench/results/speculate-2026-12-04-h200.md). Plain decoding of 2-16 rows keeps MLX's
matmul: there the gathered form's extra host time and its device time came out
even within the hosts' drift. `gather` gives it every few-row product, `kernel` (or 1)
and `verify` the kernel, `off` (or 0) neither.

Only layers that MLX itself would run as a GEMV for one row take it: plain
`nn.Linear` without a bias (a bias goes through cuBLAS's epilogue), float weights,
2 <= rows <= the form's row cap, and rows * out * in <= MAX_WORK: each row reads the
weight (gather) or each warp every row of x (kernel), so the time grows with rows x
out x in (on an H200 the kernel took 27 us for 3 rows of Llama-1B's [2048 <-> 8192]
against cuBLAS's 28, and 58 us for 8; the gathered form 74 us for 16 against 29).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import kernel_files

__all__ = ["MAX_ROWS", "MAX_WORK", "enabled", "form", "gathered", "install", "check",
           "matmul", "mode", "RowsLinear", "verifying"]

MAX_ROWS = 16  # above this cuBLAS's tiles pay for themselves (bench verify-cost)
BUCKETS = (2, 4, 8, MAX_ROWS)  # the kernels' row capacities (MAXM)
MAX_WORK = 40_000_000  # rows * out * in: above it cuBLAS is faster (see above)
GATHER_MAX_ROWS = 32  # 48 rows ran slower than cuBLAS (bench verify-cost)
WARPS = 8  # outputs per block, as MLX's gemv

_HEADER = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
template <typename T, int N> struct alignas(sizeof(T) * N) MlxnbVec { T v[N]; };
"""

# x [M, K], w [N, K] -> out [M, N]; lane l of the warp for output n sums columns
# NPT*l .. NPT*l+NPT-1, then + 32*NPT, ... (MLX's gemv_impl), float accumulators.
# K and N are template constants (the column loop unrolls); M <= MAXM is read at run
# time, since a batch's row count changes step by step. Rows past M repeat row M - 1
# (no branch in the loop) and are not written.
_BODY = r"""
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int M = x_shape[0];
    const int n = blockIdx.x * WARPS + threadIdx.y;
    if (n >= N) return;
    const T* xr[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) xr[m] = x + static_cast<int64_t>(m < M ? m : M - 1) * K;
    float sum[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) sum[m] = 0.f;
    const T* wr = w + static_cast<int64_t>(n) * K;
#pragma unroll
    for (int col = NPT * warp.thread_rank(); col < K; col += 32 * NPT) {
        const auto wv = *reinterpret_cast<const MlxnbVec<T, NPT>*>(wr + col);
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            const auto xv = *reinterpret_cast<const MlxnbVec<T, NPT>*>(xr[m] + col);
#pragma unroll
            for (int j = 0; j < NPT; ++j) {
                sum[m] += static_cast<float>(wv.v[j]) * static_cast<float>(xv.v[j]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
        const float s = cg::reduce(warp, sum[m], cg::plus<float>());
        if (m < M && warp.thread_rank() == 0) {
            out[static_cast<int64_t>(m) * N + n] = static_cast<T>(s);
        }
    }
"""

_KERNEL = []
# install's verdict for the RowsLinear layers; "all": every few-row product, else only
# while `verifying`; "thread": the one thread that calls the compiled products (MLX
# keeps traces per thread: see setup.py's `_thread`); others take nn.Linear's
_STATE = {"on": False, "all": True, "verifying": False, "form": "kernel", "thread": None}
# MLXNB_ROWS_GEMV -> (form, products): the custom kernel or MLX's gathered GEMV, for
# every few-row product or those of verifications only
_MODES = {"1": ("kernel", "all"), "kernel": ("kernel", "all"), "verify": ("kernel", "verify"),
          "gather": ("gather", "all"), "gather-verify": ("gather", "verify"),
          "": ("gather", "verify"), "0": ("gather", None), "off": ("gather", None)}
_PRODUCTS = {}  # weight shape -> compiled `matmul` (see _product)


def _env():
    return os.environ.get("MLXNB_ROWS_GEMV", "").strip().lower()


def mode() -> Optional[str]:
    """"all" (MLXNB_ROWS_GEMV=1, kernel or gather), "verify" (verify, gather-verify
    or unset: the default) or None (0 or off)."""
    return _MODES.get(_env(), (None, None))[1]


def form() -> str:
    """"kernel" (MLXNB_ROWS_GEMV=1, kernel or verify) or "gather" (the rest)."""
    return _MODES.get(_env(), ("gather", None))[0]


def enabled() -> bool:
    """Whether the engine tries the kernel (`mode` not None)."""
    return mode() is not None


@contextmanager
def verifying():
    """While a verification forward is built (on the worker thread): the products
    that "verify" mode gives the kernel."""
    before = _STATE["verifying"]
    _STATE["verifying"] = True
    try:
        yield
    finally:
        _STATE["verifying"] = before


def _kernel():
    if not _KERNEL:
        _KERNEL.append(kernel_files.cuda_kernel(
            name="mlxnb_rows_gemv", input_names=["x", "w"], output_names=["out"],
            source=_BODY, header=_HEADER))
    return _KERNEL[0]


def _npt(K: int) -> int:
    # MLX's choice for aligned operands (MLX's arrays are allocated aligned, and a
    # row of K elements keeps the alignment when K is a multiple of the vector)
    return 4 if K % 128 == 0 else 2 if K % 64 == 0 else 1


def buckets(N: int, K: int):
    """The row capacities an [N, K] weight's products can take: those holding a row
    count within MAX_WORK."""
    out, low = [], 1
    for b in BUCKETS:
        if (low + 1) * N * K <= MAX_WORK:
            out.append(b)
        low = b
    return out


def matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [M <= MAX_ROWS, K] @ w[N, K].T -> [M, N] in x's dtype, by the kernel (CUDA
    only)."""
    M, K = x.shape
    N = w.shape[0]
    return _kernel()(
        inputs=[x, w],
        template=[("T", x.dtype), ("NPT", _npt(K)), ("K", K), ("N", N),
                  ("MAXM", next(b for b in BUCKETS if M <= b)), ("WARPS", WARPS)],
        grid=(32 * ((N + WARPS - 1) // WARPS), WARPS, 1), threadgroup=(32, WARPS, 1),
        output_shapes=[(M, N)], output_dtypes=[x.dtype])[0]


_INDICES = {}  # M -> (lhs [M] 0..M-1, rhs [M] zeros): gathered's, made once per M


def gathered(x: mx.array, w: mx.array) -> mx.array:
    """x [M, K] @ w [N, K].T -> [M, N] as M one-row GEMVs in one `mx.gather_mm` (on
    CUDA: MLX's gemv_gather, each row as its one-row GEMV)."""
    M, K = x.shape
    idx = _INDICES.get(M)
    if idx is None:
        # from host lists: data, not a graph, so they hold across threads and steps
        idx = _INDICES[M] = (mx.array(list(range(M)), mx.uint32), mx.array([0] * M, mx.uint32))
    # [M, 1, K] @ [1, K, N] (w's transposed view: no copy) gathered -> [M, 1, N]
    return mx.gather_mm(x.reshape(M, 1, K), w.T[None], idx[0], idx[1]).reshape(M, -1)


def _max_rows(N: int, K: int) -> int:
    """The most rows of an [N, K] weight's product that the installed form takes."""
    cap = GATHER_MAX_ROWS if _STATE["form"] == "gather" else MAX_ROWS
    return min(cap, MAX_WORK // (N * K))


def _product(shape):
    """`matmul` compiled, one function per weight shape (each traced once per row
    count): MLX builds a custom kernel's whole source string at every call in a graph,
    host time on the critical path of a host-bound step, where a compiled function
    replays the primitive it traced."""
    f = _PRODUCTS.get(shape)
    if f is None:
        f = _PRODUCTS[shape] = mx.compile(lambda x, w: matmul(x, w))
    return f


class RowsLinear(nn.Linear):
    """nn.Linear whose product for 2..MAX_ROWS rows runs as `matmul` while the kernel
    is on (`install`); the same weights, the same parameters."""

    def __call__(self, x: mx.array) -> mx.array:
        if (_STATE["on"] and (_STATE["all"] or _STATE["verifying"]) and "bias" not in self
                and threading.get_ident() == _STATE["thread"]):
            K, w = x.shape[-1], self.weight
            rows = x.size // K if K else 0
            if 2 <= rows <= _max_rows(*w.shape) and x.dtype == w.dtype:
                x2 = x.reshape(rows, K)
                y = (gathered(x2, w) if _STATE["form"] == "gather"
                     else _product(w.shape)(x2, w))
                return y.reshape(*x.shape[:-1], w.shape[0])
        return super().__call__(x)


def _backend_ok() -> Optional[str]:
    try:
        if mx.default_device() != mx.gpu or not mx.cuda.is_available():
            return "not a CUDA device"
    except Exception:
        return "not a CUDA device"
    if _STATE["form"] == "kernel" and not hasattr(mx.fast, "cuda_kernel"):
        return "this MLX has no mx.fast.cuda_kernel"
    return None


def _check_rows(N: int, K: int):
    """The fewest and most rows the kernel takes in each capacity `buckets(N, K)`
    holds (the gathered GEMV: 2, 3 and the most)."""
    top, low, out = _max_rows(N, K), 2, set()
    if _STATE["form"] == "gather":
        return sorted({m for m in (2, 3, top) if 2 <= m <= top})
    for b in buckets(N, K):
        out |= {low, min(b, top)}
        low = b + 1
    return sorted(out)


def check(shapes, dtype) -> Optional[str]:
    """None if, for every (N, K) in `shapes`, the installed form's rows (the kernel's
    or the gathered GEMV's) equal MLX's own one-row products bit for bit (row counts
    in every capacity), else why not (one line)."""
    why = _backend_ok()
    if why:
        return why
    try:
        key = mx.random.key(7)
        for N, K in shapes:
            k1, k2, key = mx.random.split(key, 3)
            w = (mx.random.normal((N, K), key=k1) / K ** 0.5).astype(dtype)
            for M in _check_rows(N, K):
                x = mx.random.normal((M, K), key=k2).astype(dtype)
                got = (gathered if _STATE["form"] == "gather" else matmul)(x, w)
                want = mx.concatenate([x[i:i + 1] @ w.T for i in range(M)])
                if not mx.array_equal(got, want).item():
                    err = (got.astype(mx.float32) - want.astype(mx.float32)).abs().max()
                    return (f"rows differ from MLX's one-row products by {err.item():.3g} "
                            f"({N}x{K}, {M} rows, {dtype})")
    except Exception as e:
        return f"kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


def shapes(model):
    """The [N, K] weight shapes of the model's linears that can take the kernel."""
    return sorted({tuple(m.weight.shape) for _, m in _plain_linears(model)
                   if _max_rows(*m.weight.shape) >= 2})


def _plain_linears(model):
    for path, m in model.named_modules():
        if (type(m) in (nn.Linear, RowsLinear) and "bias" not in m
                and m.weight.dtype in (mx.float16, mx.bfloat16, mx.float32)):
            yield path, m


def install(model, on: Optional[bool] = None) -> str:
    """Turn the model's plain bias-free linears into RowsLinear (in place: the class
    of each module object changes, its weights stay) once `check` passes on their
    shapes, if `on` (default: `enabled()`), for `mode()`'s products; returns what
    runs ("kernel, N layers[, verifications only]" or "MLX's matmul (why)")."""
    _STATE["on"] = False
    _STATE["all"] = mode() != "verify"
    _STATE["form"] = form()
    _STATE["thread"] = threading.get_ident()
    _PRODUCTS.clear()
    if not (enabled() if on is None else on):
        return f"MLX's matmul (MLXNB_ROWS_GEMV={_env()})"
    layers, sizes = list(_plain_linears(model)), shapes(model)
    if not sizes:
        return "MLX's matmul (no plain linear layer small enough)"
    dtypes = {m.weight.dtype for _, m in layers}
    why = next((w for w in (check(sizes, d) for d in dtypes) if w), None)
    if why:
        return f"MLX's matmul ({why})"
    for _, m in layers:
        m.__class__ = RowsLinear
    _STATE["on"] = True
    what = "gathered GEMV" if _STATE["form"] == "gather" else "kernel"
    return f"{what}, {len(layers)} layers" + ("" if _STATE["all"] else ", verifications only")
