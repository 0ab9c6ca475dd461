"""A verification's attention (a few query positions per row, causal or left-padded)
in one CUDA kernel per layer, over a full-precision KV cache.

A verification forward feeds each row W positions ([B, Hq, W, D] queries). MLX's CUDA
backend would run that attention through cuDNN, building a graph per key length, so
wideattn.py composes it from plain ops instead: scale, two batched matmuls (cuBLAS),
casts, the mask's add and a softmax, where a one-position step has MLX's one fused
kernel: counted as a GPU builds them (bench/step_ops.py's `gpu_like`), the default
model's forward of 2-5 positions is 1909 graph nodes against 1447 for one, 60 of the
extra nodes cuBLAS matmuls. On H200 hosts that forward spent about 4.8 ms more host
time than one position's, whichever kernel ran its linears
(bench/results/verify-cost-2026-12-03-h200.md). Here the attention is one node a layer
(the forward's count is one position's), kv_kernels.py's dense decode kernel
given W query positions per block: position w of a row sees the keys up to
S - W + w; or, where rows are left-padded (a batch of rows of different lengths),
the keys its boolean mask [B, 1, W, S] allows.

Each block takes one query head of one row, all W positions (one head a block, so a
lane's registers hold W queries, not W times a group of heads). A group's keys past a
position's limit score -inf for it, so they add nothing to its softmax. W is read at
run time and the registers are sized for a capacity of 2, 4, 8 or 16 positions: four
kernels per model and mask kind, all compiled and loaded by the check at load, where a
kernel per width would compile (seconds each on NVRTC) and load (tens of ms) the
first time speculation reaches that width, in the middle of a run. Slots past W
repeat position W - 1 and are not written.

kv_attention.py decides where it runs (`wide_supports`) and checks it against the
composed attention on the device before the engine uses it (`self_check_wide`). On
an H200 it cut the default model's forward of 2-8 positions from 3.0-3.2 to
1.8-2.4 one-position steps (bench/results/verify-cost-2026-12-03-h200.md), so the
engine uses it on CUDA unless MLXNB_WIDE_ATTENTION=composed. Its load check
compiles all eight kernels (four capacities, causal and masked) with NVRTC in every
process: MLX keeps no custom kernel on disk (kernels_ahead.py).
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import kernel_files
from . import kv_kernels as kk

__all__ = ["CAPACITIES", "MAX_POSITIONS", "capacity", "dense_wide", "source", "wanted"]

CAPACITIES = (2, 4, 8, 16)  # query positions a block holds in registers
MAX_POSITIONS = CAPACITIES[-1]
_KERNELS = {}  # masked? -> the kernel

# the causal limit: a key past position w's last one scores -inf for that position
_LIMIT = r"""
        for (int u = 0; u < U; u++) {
            for (int r = 0; r < RQ; r++) {
                if (sidx[u] > S - W + min(r % WQ, W - 1)) sc[u][r] = NEG_INF;
            }
        }
"""
# or the mask's: position p of row b sees key s where mask[b, 0, p, s]
_MASKED = r"""
        for (int u = 0; u < U; u++) {
            for (int r = 0; r < RQ; r++) {
                if (ok[u] && !mask[b * mask_strides[0] + min(r % WQ, W - 1) * mask_strides[2]
                                   + sidx[u] * mask_strides[3]]) sc[u][r] = NEG_INF;
            }
        }
"""


def source(masked: bool = False) -> str:
    """kv_kernels' dense decode source, given WQ query slots per block (RQ = RPB * WQ
    query rows: row r is head h0 + r / WQ, slot r % WQ; slots from W on repeat
    position W - 1); causal, or `masked` by a [B, 1, W, S] boolean mask."""
    loop = (kk._LOOP.replace("/*MASK*/", "")
            .replace("/*LOAD_K*/", kk._D_LOAD.format(x="k")).replace("/*DOT*/", kk._D_DOT)
            .replace("/*LOAD_V*/", kk._D_LOAD.format(x="v")).replace("/*ACC*/", kk._D_ACC))
    shuffle_end = "        for (int r = 0; r < RPB; r++) {\n            float mn = m[r];"
    assert shuffle_end in loop
    loop = loop.replace(shuffle_end, (_MASKED if masked else _LIMIT) + shuffle_end)
    # a position whose keys in this group all lie past its limit adds nothing
    skip = "if (mn == NEG_INF) continue;  // no key of this group yet"
    assert skip in loop
    loop = loop.replace(skip, "if (mn == NEG_INF) {\n"
                        "                for (int u = 0; u < U; u++) sc[u][r] = 0.f;\n"
                        "                continue;\n            }")
    text = (kk._D_CONSTS + "    constexpr int RQ = RPB * WQ;\n"
            + kk._PROLOGUE.replace("KEYS_shape", "kd_shape") + loop + kk._EPILOGUE)
    for old, new in (
            ("const int S = kd_shape[2];",
             "const int S = kd_shape[2];\n    const int W = queries_shape[2];  // <= WQ"),
            ("(h0 + r) * queries_strides[1]",
             "(h0 + r / WQ) * queries_strides[1] + min(r % WQ, W - 1) * queries_strides[2]"),
            ("out[(b * HQ + h0 + r) * D + d] =",
             "if (r % WQ < W) out[((b * HQ + h0 + r / WQ) * W + r % WQ) * D + d] ="),
            ("[RPB]", "[RQ]"), ("r < RPB;", "r < RQ;"), ("i < RPB * D;", "i < RQ * D;")):
        assert old in text, old
        text = text.replace(old, new)
    return text


def _kernel(masked: bool):
    if masked not in _KERNELS:
        _KERNELS[masked] = kernel_files.cuda_kernel(
            name="mlxnb_dense_wide_attention" + ("_masked" if masked else ""),
            input_names=["queries", "kd", "vd"] + (["mask"] if masked else []),
            output_names=["out"], source=source(masked), ensure_row_contiguous=False)
    return _KERNELS[masked]


def capacity(W: int) -> int:
    """The fewest query slots that hold W positions."""
    return next(c for c in CAPACITIES if c >= W)


def warps_for(D: int, positions: int) -> int:
    """Warps per block: the block's combine buffer (warps x positions x D floats)
    within kv_kernels' shared-memory budget."""
    warps = kk.WARPS
    while warps > 1 and warps * positions * D * 4 > kk.SMEM_BYTES:
        warps //= 2
    return warps


def dense_wide(queries, keys, values, scale: float, mask="causal") -> mx.array:
    """queries [B, Hq, W, D] (W <= MAX_POSITIONS), keys and values [B, Hkv, S, D] ->
    [B, Hq, W, D]: position w attends to keys up to S - W + w ("causal"), or to
    those `mask` [B, 1, W, S] (bool) allows."""
    B, Hq, W, D = queries.shape
    Hkv = keys.shape[1]
    n_rep = Hq // Hkv
    WQ = capacity(W)
    warps = warps_for(D, WQ)
    masked = not isinstance(mask, str)
    return _kernel(masked)(
        inputs=[queries, keys, values] + ([mask] if masked else []),
        template=[("T", queries.dtype), ("D", D), ("NREP", n_rep), ("RPB", 1),
                  ("WARPS", warps), ("U", 1), ("WQ", WQ), ("LK", kk.dense_lanes(D)),
                  ("SCALE_BITS", kk._float_bits(scale)), ("TK", keys.dtype)],
        grid=(B * Hq * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(B, Hq, W, D)], output_dtypes=[queries.dtype])[0]


def wanted() -> bool:
    """Should verifications on this machine try the kernel (CUDA, not opted out)?"""
    from .kv_attention import cuda_backend

    return os.environ.get("MLXNB_WIDE_ATTENTION") != "composed" and cuda_backend()
