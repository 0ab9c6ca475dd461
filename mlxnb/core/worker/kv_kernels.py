"""CUDA kernels for single-token attention (decode) over a KV cache, through
`mx.fast.cuda_kernel` (kv_attention.py decides when they run and checks them).

One thread block per (row b, KV head, RPB query heads sharing it: GQA reads each key
once for all of them). A key's D values are split over LK lanes (DPL values each);
a warp holds 32/LK keys at a time, the block's NG = WARPS * 32/LK key groups stride
over the S keys, and each group keeps an online softmax (running max, sum, output).
The groups combine through warp shuffles, then the warps through shared memory.

`quantized` and `dense` load U keys per group before computing any, for more loads in
flight; kv_onekey.py's kernel, over the same prologue and epilogue, takes one key per
group and step. On an H200 (2k context, bench/results/kv-attention-2026-12-02-h200.md)
the unrolled quantized kernel ran 1.5-2.4x slower than the one-key one relative to
MLX's attention (more registers, less occupancy), so the engine tries the one-key
kernel first; the dense kernel was measured only unrolled (4-5x faster than MLX's
masked attention).

Keys and values come as
  quantized  the mx.quantize triplets (packed uint32 [B, Hkv, S, D*bits/32], scales,
             biases [B, Hkv, S, D/group]), dequantized in registers
  dense      full-precision [B, Hkv, S, D] (MLX's own attention is slow with a mask
             at some shapes; this one costs the same with and without)
Inputs may be strided views (a cache's [..., :S, :] slice of its buffer): the kernels
read strides, so nothing is copied.
"""

from __future__ import annotations

import struct
from typing import Tuple

from . import kernel_files

__all__ = ["quantized", "dense", "layout", "dense_lanes"]

WARPS = 8  # warps per thread block
SMEM_BYTES = 32 * 1024  # the block's combine buffer may use up to this
UNROLL = 4  # keys per lane group loaded before any is used
_KERNELS = {}


def _float_bits(x: float) -> int:
    # the scale rides as a compile-time int (one compile per model): a float's bits
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def _pow2_divisor(n: int, cap: int = 32) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def layout(D: int, n_rep: int) -> Tuple[int, int]:
    """(query heads per block, warps per block)."""
    rpb = max(r for r in (1, 2, 4) if n_rep % r == 0)
    warps = WARPS
    while warps > 1 and warps * rpb * D * 4 > SMEM_BYTES:
        warps //= 2
    return rpb, warps


def dense_lanes(D: int) -> int:
    """Lanes per key for a dense cache: 4 or more values each (at most 32 lanes)."""
    return _pow2_divisor(D // 4) if D % 4 == 0 else _pow2_divisor(D)


_PROLOGUE = r"""
    constexpr int KPW = 32 / LK;
    constexpr int NG = WARPS * KPW;
    constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const float scale = __int_as_float(SCALE_BITS);

    __shared__ float sm_m[WARPS][RPB];
    __shared__ float sm_l[WARPS][RPB];
    __shared__ float sm_o[WARPS][RPB][D];

    const int S = KEYS_shape[2];
    const int HKV = KEYS_shape[1];
    int blk = blockIdx.x;
    const int chunk = blk % (NREP / RPB);
    blk /= (NREP / RPB);
    const int hk = blk % HKV;
    const int b = blk / HKV;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int grp = lane / LK;
    const int sub = lane % LK;
    const int h0 = hk * NREP + chunk * RPB;

    float q[RPB][DPL];
    for (int r = 0; r < RPB; r++) {
        for (int i = 0; i < DPL; i++) {
            const int d = sub * DPL + i;
            q[r][i] = static_cast<float>(queries[b * queries_strides[0]
                + (h0 + r) * queries_strides[1] + d * queries_strides[3]]) * scale;
        }
    }
    float m[RPB], l[RPB], acc[RPB][DPL];
    for (int r = 0; r < RPB; r++) {
        m[r] = NEG_INF;
        l[r] = 0.f;
        for (int i = 0; i < DPL; i++) acc[r][i] = 0.f;
    }
"""

_LOOP = r"""
    for (int base = warp * KPW; base < S; base += NG * U) {
        bool ok[U];
        int sidx[U];
        for (int u = 0; u < U; u++) {
            const int s = base + u * NG + grp;
            sidx[u] = s;
            ok[u] = s < S;
            /*MASK*/
        }
        /*LOAD_K*/
        float sc[U][RPB];
        for (int u = 0; u < U; u++) {
            for (int r = 0; r < RPB; r++) sc[u][r] = 0.f;
            if (ok[u]) {
                /*DOT*/
            }
        }
        /*LOAD_V*/
        // the LK lanes of a key hold its partial dot products: every lane gets the sum
        for (int off = LK / 2; off > 0; off /= 2) {
            for (int u = 0; u < U; u++) {
                for (int r = 0; r < RPB; r++) {
                    sc[u][r] += __shfl_xor_sync(0xffffffffu, sc[u][r], off);
                }
            }
        }
        for (int r = 0; r < RPB; r++) {
            float mn = m[r];
            for (int u = 0; u < U; u++) {
                if (ok[u]) mn = fmaxf(mn, sc[u][r]);
            }
            if (mn == NEG_INF) continue;  // no key of this group yet
            const float corr = (m[r] == NEG_INF) ? 0.f : __expf(m[r] - mn);
            l[r] *= corr;
            for (int i = 0; i < DPL; i++) acc[r][i] *= corr;
            m[r] = mn;
            for (int u = 0; u < U; u++) {
                if (ok[u]) {
                    sc[u][r] = __expf(sc[u][r] - mn);
                    l[r] += sc[u][r];
                }
            }
        }
        for (int u = 0; u < U; u++) {
            if (ok[u]) {
                /*ACC*/
            }
        }
    }
"""

_EPILOGUE = r"""
    // the warp's key groups (lanes LK apart hold the same dims) into one
    for (int off = LK; off < 32; off *= 2) {
        for (int r = 0; r < RPB; r++) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[r], off);
            const float lo = __shfl_xor_sync(0xffffffffu, l[r], off);
            const float mn = fmaxf(m[r], mo);
            const float e1 = (m[r] == NEG_INF) ? 0.f : __expf(m[r] - mn);
            const float e2 = (mo == NEG_INF) ? 0.f : __expf(mo - mn);
            l[r] = l[r] * e1 + lo * e2;
            for (int i = 0; i < DPL; i++) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[r][i], off);
                acc[r][i] = acc[r][i] * e1 + ao * e2;
            }
            m[r] = mn;
        }
    }
    if (lane < LK) {
        for (int r = 0; r < RPB; r++) {
            if (lane == 0) {
                sm_m[warp][r] = m[r];
                sm_l[warp][r] = l[r];
            }
            for (int i = 0; i < DPL; i++) sm_o[warp][r][sub * DPL + i] = acc[r][i];
        }
    }
    __syncthreads();
    const int HQ = HKV * NREP;
    for (int i = tid; i < RPB * D; i += WARPS * 32) {
        const int r = i / D;
        const int d = i % D;
        float mx_ = NEG_INF;
        for (int k = 0; k < WARPS; k++) mx_ = fmaxf(mx_, sm_m[k][r]);
        float lsum = 0.f, o = 0.f;
        for (int k = 0; k < WARPS; k++) {
            const float e = (sm_m[k][r] == NEG_INF) ? 0.f : __expf(sm_m[k][r] - mx_);
            lsum += sm_l[k][r] * e;
            o += sm_o[k][r][d] * e;
        }
        out[(b * HQ + h0 + r) * D + d] = static_cast<T>(lsum > 0.f ? o / lsum : 0.f);
    }
"""

# quantized: each lane's WPL packed words of a key, with their groups' scale and bias
_Q_CONSTS = r"""
    constexpr int W = D * BITS / 32;
    constexpr int VPW = 32 / BITS;
    constexpr int WPL = W / LK;
    constexpr int DPL = WPL * VPW;
    constexpr uint32_t VMASK = (1u << BITS) - 1u;
"""
_Q_LOAD = r"""
        uint32_t {x}w[U][WPL];
        float {x}s_[U][WPL], {x}b_[U][WPL];
        for (int u = 0; u < U; u++) {{
            for (int j = 0; j < WPL; j++) {{
                {x}w[u][j] = 0u;
                {x}s_[u][j] = 0.f;
                {x}b_[u][j] = 0.f;
            }}
            if (ok[u]) {{
                const int s = sidx[u];
                for (int j = 0; j < WPL; j++) {{
                    const int word = sub * WPL + j;
                    const int g = word * VPW / GS;
                    {x}w[u][j] = {x}q[b * {x}q_strides[0] + hk * {x}q_strides[1]
                        + s * {x}q_strides[2] + word];
                    {x}s_[u][j] = static_cast<float>({x}s[b * {x}s_strides[0]
                        + hk * {x}s_strides[1] + s * {x}s_strides[2] + g]);
                    {x}b_[u][j] = static_cast<float>({x}b[b * {x}b_strides[0]
                        + hk * {x}b_strides[1] + s * {x}b_strides[2] + g]);
                }}
            }}
        }}
"""
_Q_DOT = r"""
                for (int j = 0; j < WPL; j++) {
                    for (int v = 0; v < VPW; v++) {
                        const float x = ks_[u][j]
                            * static_cast<float>((kw[u][j] >> (v * BITS)) & VMASK) + kb_[u][j];
                        for (int r = 0; r < RPB; r++) sc[u][r] += q[r][j * VPW + v] * x;
                    }
                }
"""
_Q_ACC = r"""
                for (int j = 0; j < WPL; j++) {
                    for (int v = 0; v < VPW; v++) {
                        const float x = vs_[u][j]
                            * static_cast<float>((vw[u][j] >> (v * BITS)) & VMASK) + vb_[u][j];
                        for (int r = 0; r < RPB; r++) acc[r][j * VPW + v] += sc[u][r] * x;
                    }
                }
"""

# dense: each lane's DPL consecutive values of a key (element loads: a cache's views
# promise no 16-byte alignment; a warp still reads whole contiguous rows)
_D_CONSTS = r"""
    constexpr int DPL = D / LK;
"""
_D_LOAD = r"""
        float {x}x[U][DPL];
        for (int u = 0; u < U; u++) {{
            const TK* p = {x}d + b * {x}d_strides[0] + hk * {x}d_strides[1]
                + sidx[u] * {x}d_strides[2] + sub * DPL * {x}d_strides[3];
            for (int i = 0; i < DPL; i++) {{
                {x}x[u][i] = ok[u] ? static_cast<float>(p[i * {x}d_strides[3]]) : 0.f;
            }}
        }}
"""
_D_DOT = r"""
                for (int i = 0; i < DPL; i++) {
                    for (int r = 0; r < RPB; r++) sc[u][r] += q[r][i] * kx[u][i];
                }
"""
_D_ACC = r"""
                for (int i = 0; i < DPL; i++) {
                    for (int r = 0; r < RPB; r++) acc[r][i] += sc[u][r] * vx[u][i];
                }
"""
_MASK = "if (ok[u]) ok[u] = mask[b * mask_strides[0] + s * mask_strides[3]];"


def _source(kind: str, masked: bool) -> str:
    if kind == "quantized":
        consts, load, dot, acc, keys = _Q_CONSTS, _Q_LOAD, _Q_DOT, _Q_ACC, "kq"
    else:
        consts, load, dot, acc, keys = _D_CONSTS, _D_LOAD, _D_DOT, _D_ACC, "kd"
    loop = (_LOOP.replace("/*MASK*/", _MASK if masked else "")
            .replace("/*LOAD_K*/", load.format(x="k")).replace("/*DOT*/", dot)
            .replace("/*LOAD_V*/", load.format(x="v")).replace("/*ACC*/", acc))
    return consts + _PROLOGUE.replace("KEYS_shape", keys + "_shape") + loop + _EPILOGUE


def _kernel(kind: str, masked: bool):
    key = (kind, masked)
    k = _KERNELS.get(key)
    if k is None:
        names = (["queries", "kq", "ks", "kb", "vq", "vs", "vb"] if kind == "quantized"
                 else ["queries", "kd", "vd"]) + (["mask"] if masked else [])
        k = _KERNELS[key] = kernel_files.cuda_kernel(
            name=f"mlxnb_{kind}_decode_attention" + ("_masked" if masked else ""),
            input_names=names, output_names=["out"], source=_source(kind, masked),
            ensure_row_contiguous=False)
    return k


def _launch(kind, inputs, template, queries, Hkv, mask, rpb, warps):
    B, Hq, _, D = queries.shape
    n_rep = Hq // Hkv
    if mask is not None:
        inputs = inputs + [mask]
    nblocks = B * Hkv * (n_rep // rpb)
    return _kernel(kind, mask is not None)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", D), ("NREP", n_rep), ("RPB", rpb),
                  ("WARPS", warps), ("U", UNROLL)] + template,
        grid=(nblocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(B, Hq, 1, D)], output_dtypes=[queries.dtype])[0]


def quantized(queries, keys, values, scale, mask, group_size, bits):
    """Decode attention over mx.quantize triplets; queries [B, Hq, 1, D]."""
    D, Hkv = queries.shape[3], keys[0].shape[1]
    rpb, warps = layout(D, queries.shape[1] // Hkv)
    return _launch("quantized", [queries, *keys, *values],
                   [("BITS", bits), ("GS", group_size), ("LK", _pow2_divisor(D * bits // 32)),
                    ("SCALE_BITS", _float_bits(scale)), ("TS", keys[1].dtype)],
                   queries, Hkv, mask, rpb, warps)


def dense(queries, keys, values, scale, mask):
    """Decode attention over full-precision keys and values [B, Hkv, S, D]."""
    D, Hkv = queries.shape[3], keys.shape[1]
    rpb, warps = layout(D, queries.shape[1] // Hkv)
    return _launch("dense", [queries, keys, values],
                   [("LK", dense_lanes(D)),
                    ("SCALE_BITS", _float_bits(scale)), ("TK", keys.dtype)],
                   queries, Hkv, mask, rpb, warps)
