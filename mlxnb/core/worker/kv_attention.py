"""Single-token attention straight off a quantized KV cache, one fused kernel per layer.

mlx-lm reads a quantized cache through `mx.quantized_matmul` (scores, then values).
MLX's CUDA backend has no quantized matmul for those shapes, so without this module a
CUDA decode step dequantizes every layer's whole cache to full precision and runs plain
attention over the copy: more bytes moved than a full-precision cache would have cost
(0.5-0.6x of its decode rate on an H200). Here one CUDA kernel per layer reads the
mx.quantize triplets (packed uint32 words, scales, biases), dequantizes in registers and
runs an online softmax: the cache is read once, in its quantized size.

Where it runs: only MLX's CUDA backend (`mx.fast.cuda_kernel`), only for decode (one
query token per row), bits 2/4/8. Metal and the CPU keep mlx-lm's quantized matmuls;
prefill chunks read their cache dequantized. `reference` is the same math in MLX ops
(what the CPU tests check against mlx-lm), and `self_check` compares the kernel with
dequantize-then-attend on the device at load before the engine uses it.

The hook: a cache in "fused" mode hands attention a `FusedKV` triplet (a tuple, so
mlx-lm's code passes it through unchanged) and mlx-lm's `scaled_dot_product_attention`
sends it to `mlx_lm.models.base.quantized_scaled_dot_product_attention`, which
`install()` wraps: FusedKV goes to `decode_attention`, anything else to mlx-lm's.
"""

from __future__ import annotations

import math
import struct
from typing import List, Optional, Tuple

import mlx.core as mx

__all__ = ["FusedKV", "decode_attention", "reference", "kernel_supports", "install",
           "self_check", "cuda_backend"]

WARPS = 8  # warps per thread block
SMEM_BYTES = 32 * 1024  # the block's combine buffer may use up to this


class FusedKV(tuple):
    """A quantized cache's (packed, scales, biases) for one layer's decode attention:
    packed [B, Hkv, S, D*bits/32] uint32, scales and biases [B, Hkv, S, D/group]."""

    __slots__ = ()


def cuda_backend() -> bool:
    """Does MLX run on its CUDA backend here?"""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except Exception:
        return False


def _pow2_divisor(n: int, cap: int = 32) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _layout(D: int, bits: int, n_rep: int) -> Tuple[int, int]:
    """(query heads per block, warps per block) for the kernel."""
    rpb = max(r for r in (1, 2, 4) if n_rep % r == 0)
    warps = WARPS
    while warps > 1 and warps * rpb * D * 4 > SMEM_BYTES:
        warps //= 2
    return rpb, warps


def kernel_supports(queries_shape, keys: FusedKV, group_size: int, bits: int,
                    mask, scale: float = 1.0) -> bool:
    """Shapes and masks the kernel takes (else the caller dequantizes)."""
    B, Hq, L, D = queries_shape
    Hkv, S = keys[0].shape[1], keys[0].shape[2]
    if L != 1 or bits not in (2, 4, 8) or D % group_size or Hq % Hkv or S == 0 \
            or not scale > 0:
        return False
    if group_size * bits < 32 or (D * bits) % 32:
        return False
    if mask is not None and not _mask_ok(mask, B, S):
        return False
    return True


def _mask_ok(mask, B, S) -> bool:
    # a boolean mask over keys, the same for every head (left padding): [B|1, 1, 1, S]
    return (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4
            and mask.shape[0] in (1, B) and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[3] == S)


# -- the CUDA kernel ---------------------------------------------------------------------
# One block per (row b, KV head, chunk of RPB query heads sharing it). A key is read by
# LK lanes (LK: a power of two dividing its W packed words, at most 32), each lane WPL
# words; a warp holds 32/LK keys at once and the block's NG key groups stride over S.
# Each group keeps a running max, sum and output (online softmax); groups combine
# through warp shuffles, then the warps through shared memory.
_SOURCE = r"""
    constexpr int W = D * BITS / 32;
    constexpr int VPW = 32 / BITS;
    constexpr int WPL = W / LK;
    constexpr int DPL = WPL * VPW;
    constexpr int KPW = 32 / LK;
    constexpr int NG = WARPS * KPW;
    constexpr uint32_t VMASK = (BITS == 32) ? 0xffffffffu : ((1u << BITS) - 1u);
    constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const float scale = __int_as_float(SCALE_BITS);

    __shared__ float sm_m[WARPS][RPB];
    __shared__ float sm_l[WARPS][RPB];
    __shared__ float sm_o[WARPS][RPB][D];

    const int S = kq_shape[2];
    const int HKV = kq_shape[1];
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
            int d = sub * DPL + i;
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

    const uint32_t* kq_row = kq + b * kq_strides[0] + hk * kq_strides[1];
    const uint32_t* vq_row = vq + b * vq_strides[0] + hk * vq_strides[1];
    for (int s0 = warp * KPW; s0 < S; s0 += NG) {
        const int s = s0 + grp;
        bool valid = s < S;
        /*MASK*/
        float sc[RPB];
        for (int r = 0; r < RPB; r++) sc[r] = 0.f;
        if (valid) {
            for (int j = 0; j < WPL; j++) {
                const int word = sub * WPL + j;
                const int g = word * VPW / GS;
                const uint32_t w = kq_row[s * kq_strides[2] + word];
                const float sk = static_cast<float>(ks[b * ks_strides[0]
                    + hk * ks_strides[1] + s * ks_strides[2] + g]);
                const float bk = static_cast<float>(kb[b * kb_strides[0]
                    + hk * kb_strides[1] + s * kb_strides[2] + g]);
                for (int v = 0; v < VPW; v++) {
                    const float x = sk * static_cast<float>((w >> (v * BITS)) & VMASK) + bk;
                    for (int r = 0; r < RPB; r++) sc[r] += q[r][j * VPW + v] * x;
                }
            }
        }
        // the LK lanes of a key hold its partial dot products: every lane gets the sum
        for (int off = LK / 2; off > 0; off /= 2) {
            for (int r = 0; r < RPB; r++) sc[r] += __shfl_xor_sync(0xffffffffu, sc[r], off);
        }
        if (valid) {
            float p[RPB], corr[RPB];
            for (int r = 0; r < RPB; r++) {
                const float mn = fmaxf(m[r], sc[r]);
                corr[r] = __expf(m[r] - mn);
                p[r] = __expf(sc[r] - mn);
                l[r] = l[r] * corr[r] + p[r];
                m[r] = mn;
            }
            for (int j = 0; j < WPL; j++) {
                const int word = sub * WPL + j;
                const int g = word * VPW / GS;
                const uint32_t w = vq_row[s * vq_strides[2] + word];
                const float sv = static_cast<float>(vs[b * vs_strides[0]
                    + hk * vs_strides[1] + s * vs_strides[2] + g]);
                const float bv = static_cast<float>(vb[b * vb_strides[0]
                    + hk * vb_strides[1] + s * vb_strides[2] + g]);
                for (int v = 0; v < VPW; v++) {
                    const float x = sv * static_cast<float>((w >> (v * BITS)) & VMASK) + bv;
                    for (int r = 0; r < RPB; r++) {
                        acc[r][j * VPW + v] = acc[r][j * VPW + v] * corr[r] + p[r] * x;
                    }
                }
            }
        }
    }
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

# only the masked variant has a `mask` input (left-padded rows: [B, 1, 1, S] bool)
_MASK_LINE = "if (valid) valid = mask[b * mask_strides[0] + s * mask_strides[3]];"
_KERNELS = {}


def _kernel(masked: bool):
    k = _KERNELS.get(masked)
    if k is None:
        names = ["queries", "kq", "ks", "kb", "vq", "vs", "vb"] + (["mask"] if masked else [])
        k = _KERNELS[masked] = mx.fast.cuda_kernel(
            name="mlxnb_qkv_decode_attention" + ("_masked" if masked else ""),
            input_names=names, output_names=["out"],
            source=_SOURCE.replace("/*MASK*/", _MASK_LINE if masked else ""),
            ensure_row_contiguous=False)
    return k


def _fused_cuda(queries, keys, values, scale, mask, group_size, bits):
    B, Hq, _, D = queries.shape
    Hkv = keys[0].shape[1]
    n_rep = Hq // Hkv
    rpb, warps = _layout(D, bits, n_rep)
    lk = _pow2_divisor(D * bits // 32)
    inputs = [queries, *keys, *values]
    masked = mask is not None
    if masked:
        inputs.append(mask)
    # the scale rides as a compile-time constant (one compile per model): its bits
    scale_bits = struct.unpack("<i", struct.pack("<f", float(scale)))[0]
    nblocks = B * Hkv * (n_rep // rpb)
    return _kernel(masked)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", D), ("BITS", bits), ("GS", group_size),
                  ("NREP", n_rep), ("RPB", rpb), ("WARPS", warps), ("LK", lk),
                  ("SCALE_BITS", scale_bits), ("TS", keys[1].dtype)],
        grid=(nblocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(B, Hq, 1, D)], output_dtypes=[queries.dtype])[0]


# -- the same math in MLX ops -------------------------------------------------------------
def _unpack(trip, group_size: int, bits: int) -> mx.array:
    """Dequantize a triplet the kernel's way: value i of a word is bits i*b..i*b+b-1,
    then scale * value + bias per group (float32)."""
    w, scales, biases = trip
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    vals = (w[..., None] >> shifts) & mx.array((1 << bits) - 1, mx.uint32)
    vals = vals.reshape(*w.shape[:-1], -1).astype(mx.float32)  # [..., S, D]
    D = vals.shape[-1]
    g = vals.reshape(*vals.shape[:-1], D // group_size, group_size)
    x = g * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return x.reshape(vals.shape)


def reference(queries, keys, values, scale, mask, group_size: int, bits: int,
              groups: int = 4) -> mx.array:
    """The kernel's math in MLX ops: float32 dot products against the unpacked keys,
    keys split into `groups` interleaved sets (key s in set s % groups) with an online
    softmax each, then the sets combined by their maxima. queries [B, Hq, 1, D]."""
    B, Hq, L, D = queries.shape
    Hkv, S = keys[0].shape[1], keys[0].shape[2]
    n_rep = Hq // Hkv
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, n_rep, L, D)
    k = _unpack(keys, group_size, bits)[:, :, None]  # [B, Hkv, 1, S, D]
    v = _unpack(values, group_size, bits)[:, :, None]
    s = q @ k.swapaxes(-1, -2)  # [B, Hkv, n_rep, L, S]
    valid = mx.ones((1, 1, 1, 1, S), mx.bool_)
    if mask is not None:
        valid = mx.broadcast_to(mask, (mask.shape[0], 1, 1, S))[:, :, None]
    neg = mx.array(-math.inf, mx.float32)
    s = mx.where(valid, s, neg)
    which = mx.arange(S) % groups
    ms, ls, os = [], [], []
    for g in range(groups):
        sel = which == g
        sg = mx.where(sel, s, neg)
        m = sg.max(axis=-1, keepdims=True)
        p = mx.where(sel & valid, mx.exp(sg - mx.where(m == -math.inf, 0, m)), 0)
        ms.append(m)
        ls.append(p.sum(axis=-1, keepdims=True))
        os.append(p @ v)
    M = mx.stack(ms).max(axis=0)
    e = [mx.where(m == -math.inf, 0, mx.exp(m - M)) for m in ms]
    lsum = sum(li * ei for li, ei in zip(ls, e))
    o = sum(oi * ei for oi, ei in zip(os, e))
    out = mx.where(lsum > 0, o / mx.where(lsum > 0, lsum, 1), 0)
    return out.reshape(B, Hq, L, D).astype(queries.dtype)


def decode_attention(queries, keys: FusedKV, values: FusedKV, scale: float, mask,
                     group_size: int, bits: int) -> mx.array:
    """Attention of one query token per row over a quantized cache: the fused kernel
    on CUDA, the same math in MLX ops elsewhere. The caller checked kernel_supports."""
    if mask is not None and mask.shape[0] == 1 and queries.shape[0] > 1:
        mask = mx.broadcast_to(mask, (queries.shape[0],) + mask.shape[1:])
    if cuda_backend():
        return _fused_cuda(queries, keys, values, scale, mask, group_size, bits)
    return reference(queries, keys, values, scale, mask, group_size, bits)


def dequantized_attention(queries, keys, values, scale, mask, group_size, bits):
    """The fallback: dequantize the whole cache, then MLX's attention."""
    k = mx.dequantize(*keys, group_size=group_size, bits=bits)
    v = mx.dequantize(*values, group_size=group_size, bits=bits)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


# -- the hook into mlx-lm -------------------------------------------------------------------
_seen: Optional[List[tuple]] = None  # while recording: each call's shapes (self_check)


def install() -> None:
    """Wrap mlx-lm's quantized attention so FusedKV triplets reach decode_attention
    (idempotent; anything else still goes to mlx-lm's own function)."""
    from mlx_lm.models import base
    orig = base.quantized_scaled_dot_product_attention
    if getattr(orig, "_mlxnb_fused", False):
        return

    def quantized_sdpa(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        if not isinstance(q_keys, FusedKV):
            return orig(queries, q_keys, q_values, scale, mask, group_size, bits)
        if isinstance(mask, str):  # "causal" for one query: every key
            mask = None
        if _seen is not None:
            _seen.append((queries.shape[1], q_keys[0].shape[1], queries.shape[3],
                          queries.dtype, q_keys[1].dtype, float(scale), group_size, bits))
        if kernel_supports(queries.shape, q_keys, group_size, bits, mask, scale):
            return decode_attention(queries, q_keys, q_values, scale, mask, group_size, bits)
        return dequantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits)

    quantized_sdpa._mlxnb_fused = True
    base.quantized_scaled_dot_product_attention = quantized_sdpa


class recording:
    """`with recording() as calls:` collects the shapes of the fused calls a probe
    forward makes: (Hq, Hkv, D, query dtype, scales dtype, scale, group, bits)."""

    def __enter__(self):
        global _seen
        _seen = []
        return _seen

    def __exit__(self, *exc):
        global _seen
        _seen = None


def self_check(calls: List[tuple], S: int = 300, B: int = 3, seed: int = 0) -> Optional[str]:
    """Run decode_attention against dequantize-then-attend on this device at each
    recorded shape, with and without a left-padding mask. None if every case
    matches; else what went wrong (one line)."""
    key = mx.random.key(seed)
    for Hq, Hkv, D, qdt, sdt, scale, gs, bits in sorted(set(calls), key=str):
        try:
            k1, k2, k3, key = mx.random.split(key, 4)
            q = mx.random.normal((B, Hq, 1, D), key=k1).astype(qdt)
            k = mx.random.normal((B, Hkv, S, D), key=k2).astype(sdt)
            v = mx.random.normal((B, Hkv, S, D), key=k3).astype(sdt)
            kq = FusedKV(mx.quantize(k, group_size=gs, bits=bits))
            vq = FusedKV(mx.quantize(v, group_size=gs, bits=bits))
            pad = mx.array([0, 7, S - 5][:B] + [0] * max(0, B - 3))
            masks = [None, (pad[:, None, None, None] <= mx.arange(S))]
            for mask in masks:
                if not kernel_supports(q.shape, kq, gs, bits, mask, scale):
                    return f"no kernel for shape Hq={Hq} Hkv={Hkv} D={D} bits={bits}"
                got = decode_attention(q, kq, vq, scale, mask, gs, bits).astype(mx.float32)
                want = dequantized_attention(q, kq, vq, scale, mask, gs, bits)
                want = want.astype(mx.float32)
                err = (got - want).abs().max().item()
                tol = 0.02 + 0.02 * want.abs().max().item()
                if not err <= tol:  # also catches NaN
                    return (f"fused kernel differs from dequantized attention by {err:.3g} "
                            f"(Hq={Hq} Hkv={Hkv} D={D} bits={bits} group={gs}"
                            f"{' masked' if mask is not None else ''})")
        except Exception as e:
            return f"fused kernel failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None
