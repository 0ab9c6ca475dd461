"""The one-key CUDA kernel for single-token attention over a quantized KV cache
(`mx.fast.cuda_kernel`): kv_kernels.py's layout, prologue and epilogue, with one key
per lane group and step where kv_kernels.quantized loads U keys ahead. The engine
tries it first (kv_attention.py): on an H200 it ran 1.5-2.4x faster relative to MLX's
attention than the unrolled kernel (bench/results/kv-attention-2026-12-02-h200.md)."""

from __future__ import annotations

from . import kernel_files
from . import kv_kernels as kk

__all__ = ["quantized"]

_KERNELS = {}  # masked -> the kernel

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
    constexpr uint32_t VMASK = (BITS == 32) ? 0xffffffffu : ((1u << BITS) - 1u);
""" + kk._PROLOGUE.replace("KEYS_shape", "kq_shape") + r"""

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
""" + kk._EPILOGUE  # one reduction and write-out, as kv_kernels.py's

# only the masked variant has a `mask` input (left-padded rows: [B, 1, 1, S] bool)
_MASK_LINE = "if (valid) valid = mask[b * mask_strides[0] + s * mask_strides[3]];"


def _kernel(masked: bool):
    k = _KERNELS.get(masked)
    if k is None:
        names = ["queries", "kq", "ks", "kb", "vq", "vs", "vb"] + (["mask"] if masked else [])
        k = _KERNELS[masked] = kernel_files.cuda_kernel(
            name="mlxnb_qkv_decode_attention" + ("_masked" if masked else ""),
            input_names=names, output_names=["out"],
            source=_SOURCE.replace("/*MASK*/", _MASK_LINE if masked else ""),
            ensure_row_contiguous=False)
    return k


def quantized(queries, keys, values, scale, mask, group_size, bits):
    """Decode attention over quantized keys and values (the mx.quantize triplets): one
    key per LK-lane group per iteration."""
    B, Hq, _, D = queries.shape
    Hkv = keys[0].shape[1]
    n_rep = Hq // Hkv
    rpb, warps = kk.layout(D, n_rep)
    lk = kk._pow2_divisor(D * bits // 32)
    inputs = [queries, *keys, *values]
    masked = mask is not None
    if masked:
        inputs.append(mask)
    # the scale rides as a compile-time constant (one compile per model): its bits
    scale_bits = kk._float_bits(scale)
    nblocks = B * Hkv * (n_rep // rpb)
    return _kernel(masked)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", D), ("BITS", bits), ("GS", group_size),
                  ("NREP", n_rep), ("RPB", rpb), ("WARPS", warps), ("LK", lk),
                  ("SCALE_BITS", scale_bits), ("TS", keys[1].dtype)],
        grid=(nblocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(B, Hq, 1, D)], output_dtypes=[queries.dtype])[0]


