"""The stacked low-rank update of a folded linear in one GPU kernel (lowrank.py's
`Stacked.apply` uses it when `kernel_for` returns one).

With `fold` the linear's matmul already yields y2 = [x @ W^T | x @ A_all], [rows,
out + C]. The ops that remain per adapted linear (slice z, mask multiply, addmm with
B_all, slice and reshape) cost host time on a GPU, where a decode step is host-bound;
this kernel takes y2 whole and writes

    y[r, j] = y2[r, j] + scale_row * sum over c in cols(row's adapter, part of j)
                                     of y2[r, out + c] * B_all[c, j]

in the model's dtype, accumulating in float32: only the row's own rank-r columns
(the block of its adapter for the fused part that owns column j; B_all is zero
elsewhere), a row with no adapter copies its base product. Its output is [B, L,
out], so no reshape follows either. `tab` [parts, slots + 1, 2] int32 holds each
(part, slot)'s columns (c0, c1) (c0 == c1: none), `bounds` [parts + 1] int32 the
parts' output columns.

`reference` is the same math in MLX ops (float32, masked over all C columns);
`self_check` compares a kernel with it on a small input on this device before any
adapter uses it, and `kernel_for` falls back to lowrank.py's ops, with the reason,
where it differs, raises, or where there is no GPU kernel API (the CPU).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..._log import log
from . import kernel_files

__all__ = ["backend", "reference", "table", "self_check", "kernel_for", "status"]

THREADS = 256  # threads per block: output columns of one row

_CUDA = r"""
    // a 1-D grid (gridDim.y would cap the rows at 65535): NCB blocks per row
    constexpr int NCB = (OUT + TX - 1) / TX;
    const int r = blockIdx.x / NCB;
    const int j = (blockIdx.x % NCB) * TX + threadIdx.x;
    if (j >= OUT) return;
    const int W = y2_shape[1];  // out + C
    const int WB = bmat_shape[1];  // B_all's row stride: out, or out + C (padded)
    const int L = y2_shape[0] / slot_shape[0];
    const int b = r / L;
    const int ns = tab_shape[1];
    int p = 0;
    while (p + 1 < NP && j >= bounds[p + 1]) p++;
    const int e = (p * ns + static_cast<int>(slot[b])) * 2;
    const int c0 = tab[e], c1 = tab[e + 1];
    const T* row = y2 + static_cast<int64_t>(r) * W;
    float acc = 0.f;
    for (int c = c0; c < c1; c++) {
        acc += static_cast<float>(row[OUT + c]) * static_cast<float>(bmat[c * WB + j]);
    }
    out[static_cast<int64_t>(r) * OUT + j] =
        static_cast<T>(static_cast<float>(row[j]) + scale[b] * acc);
"""

# the same logic; MLX's metal_kernel dispatches exactly `grid` threads
_METAL = r"""
    const int j = int(thread_position_in_grid.x);
    const int r = int(thread_position_in_grid.y);
    if (j >= OUT) return;
    const int W = int(y2_shape[1]);
    const int WB = int(bmat_shape[1]);
    const int L = int(y2_shape[0]) / int(slot_shape[0]);
    const int b = r / L;
    const int ns = int(tab_shape[1]);
    int p = 0;
    while (p + 1 < NP && j >= bounds[p + 1]) p++;
    const int e = (p * ns + int(slot[b])) * 2;
    const int c0 = tab[e], c1 = tab[e + 1];
    const size_t base = size_t(r) * size_t(W);
    float acc = 0.f;
    for (int c = c0; c < c1; c++) {
        acc += static_cast<float>(y2[base + OUT + c]) * static_cast<float>(bmat[c * WB + j]);
    }
    out[size_t(r) * OUT + j] = static_cast<T>(static_cast<float>(y2[base + j]) + scale[b] * acc);
"""

_NAMES = ["y2", "bmat", "tab", "bounds", "slot", "scale"]
_KERNELS: Dict[str, object] = {}
_CHECKED: Dict[tuple, Optional[str]] = {}  # (backend, dtype) -> None or why not
_LAUNCHERS: Dict[str, Callable] = {}  # backend -> its one launcher


def backend() -> Optional[str]:
    """"cuda" or "metal" where MLX runs on that GPU backend and has its kernel API,
    else None (the CPU: lowrank.py's ops)."""
    try:
        if mx.default_device() != mx.gpu:
            return None
        if mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel"):
            return "cuda"
        if mx.metal.is_available() and hasattr(mx.fast, "metal_kernel"):
            return "metal"
    except Exception:
        pass
    return None


def table(layout_blocks, parts, names) -> Tuple[mx.array, mx.array]:
    """(tab [parts, slots + 1, 2] int32, bounds [parts + 1] int32) for a Stacked's
    `blocks` {(path, name): (c0, c1)} and `parts` [(path, out)] over slots `names`
    (the last slot: no adapter, no columns)."""
    tab = np.zeros((len(parts), len(names) + 1, 2), np.int32)
    bounds, o = [0], 0
    for p, (path, width) in enumerate(parts):
        for s, n in enumerate(names):
            tab[p, s] = layout_blocks.get((path, n), (0, 0))
        o += width
        bounds.append(o)
    return mx.array(tab), mx.array(np.array(bounds, np.int32))


def _launch(kind: str, y2, bmat, tab, bounds, slot, scale, B: int, L: int, out: int):
    k = _KERNELS.get(kind)
    if k is None:
        make = kernel_files.cuda_kernel if kind == "cuda" else mx.fast.metal_kernel
        k = _KERNELS[kind] = make(name="mlxnb_stacked_lowrank_update", input_names=_NAMES,
                                  output_names=["out"],
                                  source=_CUDA if kind == "cuda" else _METAL)
    tx = min(THREADS, 1 << max(out - 1, 1).bit_length())
    grid = ((out + tx - 1) // tx * tx * B * L, 1, 1) if kind == "cuda" else (out, B * L, 1)
    return k(inputs=[y2, bmat, tab, bounds, slot, scale],
             template=[("T", y2.dtype), ("OUT", out), ("NP", int(tab.shape[0])),
                       ("TX", tx)],
             grid=grid, threadgroup=(tx, 1, 1),
             output_shapes=[(B, L, out)], output_dtypes=[y2.dtype])[0]


def reference(y2, bmat, mask, scale, B: int, L: int, out: int) -> mx.array:
    """The kernel's math in MLX ops: y2 [B * L, out + C], bmat [C, >= out] (B_all),
    mask [B, C] 1 on the columns of each row's adapter, scale [B] float32 ->
    [B, L, out] in y2's dtype."""
    f32 = mx.float32
    m = mx.repeat(mask.astype(f32), L, axis=0)  # [B * L, C]
    z = y2[:, out:].astype(f32) * m
    u = z @ bmat[:, :out].astype(f32)
    s = mx.repeat(scale.astype(f32).reshape(-1), L)[:, None]
    return (y2[:, :out].astype(f32) + s * u).astype(y2.dtype).reshape(B, L, out)


Launch = Callable[..., mx.array]


def self_check(dtype, launch: Launch, seed: int = 0) -> Optional[str]:
    """`launch(y2, bmat, tab, bounds, slot, scale, B, L, out)` against `reference`
    on a small input: two parts (a fused group), adapters of ranks 3 and 5 (one not
    covering the second part), rows of each and one with none, one and three tokens
    a row. None if it matches, else what went wrong (one line)."""
    try:
        parts = [("p0", 40), ("p1", 300)]
        names = ["a", "b"]
        cols = {("p0", "a"): (0, 3), ("p0", "b"): (3, 8), ("p1", "a"): (8, 11)}
        C, out = 11, 340
        tab, bounds = table(cols, parts, names)
        key = mx.random.key(seed)
        k1, k2 = mx.random.split(key)
        k2 = mx.random.split(k2, 4)
        bmat = mx.random.normal((C, out + C), key=k1)
        keep = np.zeros((C, out + C), np.float32)  # block-diagonal onto the parts
        for (path, n), (c0, c1) in cols.items():
            o0, o1 = (0, 40) if path == "p0" else (40, 340)
            keep[c0:c1, o0:o1] = 1
        bmat = (bmat * mx.array(keep)).astype(dtype)
        adapters = ["a", None, "b", "a"]
        slot = mx.array(np.array([names.index(a) if a else len(names) for a in adapters],
                                 np.uint32))
        scale = mx.array(np.array([2.0, 0.0, 0.5, 2.0], np.float32))
        mask = mx.array(np.stack([[float(any(n == a and c0 <= c < c1
                                             for (_, n), (c0, c1) in cols.items()))
                                   for c in range(C)] for a in adapters]))
        B = len(adapters)
        for L in (1, 3):
            y2 = mx.random.normal((B * L, out + C), key=k2[L]).astype(dtype)
            got = launch(y2, bmat, tab, bounds, slot, scale, B, L, out)
            want = reference(y2, bmat, mask, scale, B, L, out)
            if tuple(got.shape) != (B, L, out) or got.dtype != dtype:
                return (f"kernel gave {tuple(got.shape)} {got.dtype}, want "
                        f"{(B, L, out)} {dtype}")
            if not mx.array_equal(got[1], y2[L:2 * L, :out]).item():
                return "kernel changed a row with no adapter"
            g, w = got.astype(mx.float32), want.astype(mx.float32)
            err = (g - w).abs().max().item()
            # float32: the reference's matmul may run as TF32 on a GPU (measured 1.3e-4
            # of the largest value on an H200); a wrong column is off by whole values
            eps = {mx.float32: 1e-3, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}.get(dtype, 2e-2)
            tol = 2 * eps * max(1.0, w.abs().max().item())
            if not err <= tol:  # also catches NaN
                return f"kernel differs from the ops by {err:.3g} ({dtype}, L={L})"
    except Exception as e:
        return f"kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


def kernel_for(dtype) -> Tuple[Optional[Launch], str]:
    """(the update kernel for arrays of `dtype`, or None; why not, or "") after its
    self-check on this device (once per process and dtype)."""
    kind = backend()
    if kind is None:
        return None, "no GPU kernel API on this device"

    launch = _LAUNCHERS.get(kind)
    if launch is None:  # one per backend: lowrank.py compiles a decode step per launcher
        def launch(*a):
            return _launch(kind, *a)

        _LAUNCHERS[kind] = launch
    key = (kind, dtype)
    if key not in _CHECKED:
        why = _CHECKED[key] = self_check(dtype, launch)
        if why:
            log.warning("stacked LoRA update kernel not used (%s): %s", dtype, why)
    why = _CHECKED[key]
    return (None, why) if why else (launch, "")


def status(dtype) -> str:
    """'kernel' or 'ops (why)' for `dtype` as kernel_for would pick now."""
    k, why = kernel_for(dtype)
    return "kernel" if k is not None else f"ops ({why})"
