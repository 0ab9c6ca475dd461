"""Decode attention over a quantized KV cache (kv_attention.py): the fused kernel's
math against mlx-lm's quantized attention, the rule that picks the path at load, the
self-check that falls back to dequantizing, and greedy parity through the engine on
the fused path (its MLX-ops form here; the CUDA kernel runs only on CUDA)."""

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_qsdpa

from mlxnb.core.worker import kv_attention as ka
from test_cache_kinds import PROMPTS, engine, mlx_lm_tokens  # tests/ is on sys.path

SHAPES = [  # (Hq, Hkv, D, group, bits)
    (8, 2, 64, 32, 4), (4, 4, 128, 64, 8), (6, 2, 256, 64, 4), (4, 2, 32, 32, 2),
    (8, 1, 64, 64, 8), (32, 8, 64, 64, 4),
]


def _case(Hq, Hkv, D, gs, bits, B=3, S=41, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, 1, D), key=k1)
    k = mx.random.normal((B, Hkv, S, D), key=k2)
    v = mx.random.normal((B, Hkv, S, D), key=k3)
    return (q, ka.FusedKV(mx.quantize(k, group_size=gs, bits=bits)),
            ka.FusedKV(mx.quantize(v, group_size=gs, bits=bits)))


@pytest.mark.parametrize("Hq,Hkv,D,gs,bits", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_reference_matches_mlx_lm_quantized_attention(Hq, Hkv, D, gs, bits, masked):
    q, kq, vq = _case(Hq, Hkv, D, gs, bits)
    S = kq[0].shape[2]
    # left padding as the engine's batch caches mask it: row 2 sees only its last 3 keys
    mask = (mx.array([0, 5, S - 3])[:, None, None, None] <= mx.arange(S)) if masked else None
    scale = D ** -0.5
    assert ka.kernel_supports(q.shape, kq, gs, bits, mask, scale)
    got = ka.reference(q, kq, vq, scale, mask, gs, bits)
    want = mlx_lm_qsdpa(q * 1, tuple(kq), tuple(vq), scale, mask, gs, bits)  # (scales q in place)
    assert got.shape == want.shape == (3, Hq, 1, D)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    deq = ka.dequantized_attention(q, kq, vq, scale, mask, gs, bits)
    assert mx.allclose(got, deq, atol=1e-4, rtol=1e-4).item()
    if masked:  # the mask matters: without it row 2's output differs
        free = ka.reference(q, kq, vq, scale, None, gs, bits)
        assert not mx.allclose(free[2], got[2], atol=1e-3).item()


def test_kernel_supports_decode_shapes_only():
    q, kq, _ = _case(8, 2, 64, 32, 4)
    assert ka.kernel_supports(q.shape, kq, 32, 4, None, 0.125)
    assert not ka.kernel_supports((3, 8, 2, 64), kq, 32, 4, None, 0.125)  # 2 query tokens
    assert not ka.kernel_supports(q.shape, kq, 32, 3, None, 0.125)  # 3-bit words straddle
    wide = ka.FusedKV(mx.quantize(mx.zeros((1, 2, 8, 512)), group_size=64, bits=4))
    assert not ka.kernel_supports((1, 8, 1, 512), wide, 64, 4, None, 0.125)  # registers
    S = kq[0].shape[2]
    additive = mx.zeros((3, 1, 1, S))
    assert not ka.kernel_supports(q.shape, kq, 32, 4, additive, 0.125)
    per_head = mx.ones((3, 8, 1, S), mx.bool_)
    assert not ka.kernel_supports(q.shape, kq, 32, 4, per_head, 0.125)
    assert ka.kernel_supports(q.shape, kq, 32, 4, mx.ones((1, 1, 1, S), mx.bool_), 0.125)


def test_self_check_passes_the_reference_and_names_a_wrong_kernel(monkeypatch):
    calls = [(8, 2, 64, mx.float32, mx.float32, 0.125, 32, 4),
             (4, 4, 128, mx.bfloat16, mx.bfloat16, 128 ** -0.5, 64, 8)]
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_fused_cuda", ka.reference)
    assert ka.self_check(calls) is None

    def off_by_a_bit(q, k, v, scale, mask, gs, bits):  # e.g. values unpacked high end first
        return ka.reference(q, k, v, scale, mask, gs, bits) * 1.1

    monkeypatch.setattr(ka, "_fused_cuda", off_by_a_bit)
    why = ka.self_check(calls)
    assert why and why.startswith("fused kernel differs from dequantized attention")

    def ignores_mask(q, k, v, scale, mask, gs, bits):
        return ka.reference(q, k, v, scale, None, gs, bits)

    monkeypatch.setattr(ka, "_fused_cuda", ignores_mask)
    assert "masked" in ka.self_check(calls)

    def raises(*a):
        raise RuntimeError("nvrtc: error: identifier \"x\" is undefined")

    monkeypatch.setattr(ka, "_fused_cuda", raises)
    assert ka.self_check(calls).startswith("fused kernel failed: RuntimeError: nvrtc")


def _run_engine(kv):
    async def main():
        eng = engine("llama", **kv)
        alone = [(await eng.submit(p, max_tokens=12, chat=False)).tokens for p in PROMPTS]
        # three rows prefill as one padded group, the fourth joins: left-padded decode
        rows = [eng.submit(p, max_tokens=12, chat=False) for p in PROMPTS[:3]]
        while not any(r.tokens for r in rows):
            await asyncio.sleep(0.001)
        rows.append(eng.submit(PROMPTS[3], max_tokens=12, chat=False))
        batched = [(await r).tokens for r in rows]
        ids = rows[1].prompt_ids
        status = eng.status()
        await eng.aclose()
        return alone, batched, ids, status, eng.quantized_attention
    return main


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_path_keeps_greedy_parity(bits, monkeypatch, arun):
    """On a CUDA-like backend the engine picks the fused path; with the kernel's math
    (MLX ops here) batched == alone == mlx-lm's own generation, and every decode
    attention call of the run took the fused path."""
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    fused_calls = []

    def kernel(q, k, v, scale, mask, gs, b):
        fused_calls.append(mask is not None)
        return ka.reference(q, k, v, scale, mask, gs, b)

    monkeypatch.setattr(ka, "_fused_cuda", kernel)
    kv = dict(kv_bits=bits, kv_group_size=32)
    alone, batched, ids, status, qa = arun(_run_engine(kv))
    assert f"KV {bits}-bit (decode attention: fused quantized-KV kernel)" in status
    assert qa
    assert batched == alone
    assert alone[1] == mlx_lm_tokens("llama", ids, 12, **kv)
    assert True in fused_calls and False in fused_calls  # padded and aligned batches


def test_failed_self_check_falls_back_to_dequantized(monkeypatch, arun):
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_fused_cuda", lambda q, *a: mx.zeros_like(q))
    kv = dict(kv_bits=4, kv_group_size=32)
    alone, batched, ids, status, qa = arun(_run_engine(kv))
    assert "KV 4-bit (dequantized for attention on this device: fused kernel differs" in status
    assert not qa
    assert batched == alone
    assert alone[1] == mlx_lm_tokens("llama", ids, 12, **kv)


def test_metal_and_cpu_keep_mlx_lm_quantized_attention(monkeypatch):
    def never(*a):
        raise AssertionError("the fused path ran off CUDA")

    monkeypatch.setattr(ka, "_fused_cuda", never)
    eng = engine("llama", kv_bits=4, kv_group_size=32)
    try:
        assert not ka.cuda_backend()
        assert eng.cache_kinds.endswith("KV 4-bit")
        assert eng.quantized_attention
    finally:
        eng.close()


def test_dense_path_on_padded_batches_keeps_greedy_parity(monkeypatch, arun):
    """A full-precision cache: on a CUDA-like backend, padded batches' decode
    attention goes to the dense kernel (its stand-in here: MLX's attention, counted),
    unpadded ones stay on MLX's; tokens are unchanged."""
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    masks = []

    def kernel(q, k, v, scale, mask):
        if k.shape[2] != 300:  # (not the load-time self-check's calls)
            masks.append(mask is not None)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(ka, "_dense_cuda", kernel)
    try:
        alone, batched, ids, status, _ = arun(_run_engine({}))
    finally:
        from mlxnb.core.worker.caches import LeanBatchKVCache
        LeanBatchKVCache.dense_decode = False
    assert "padded decode attention: fused kernel" in status
    assert batched == alone
    assert alone[1] == mlx_lm_tokens("llama", ids, 12)
    assert masks and all(masks)  # padded batches only (the joined row padded them)


def test_dense_self_check_names_a_wrong_kernel_and_engine_falls_back(monkeypatch, arun):
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    monkeypatch.setattr(ka, "_dense_cuda", lambda q, k, v, scale, mask: q * 0)
    why = ka.self_check_dense([(4, 2, 32, mx.float32, mx.float32, 32 ** -0.5)])
    assert why.startswith("dense kernel differs from MLX's attention")
    alone, batched, ids, status, _ = arun(_run_engine({}))
    assert "padded decode attention: MLX's (dense kernel differs" in status
    assert batched == alone


def test_dense_supports_single_tokens_and_key_masks():
    k = mx.zeros((3, 2, 40, 64), mx.bfloat16)
    assert ka.dense_supports((3, 8, 1, 64), k, None, 0.125)
    assert ka.dense_supports((3, 8, 1, 64), k, mx.ones((3, 1, 1, 40), mx.bool_), 0.125)
    assert not ka.dense_supports((3, 8, 4, 64), k, None, 0.125)
    assert not ka.dense_supports((3, 8, 1, 64), k, mx.zeros((3, 1, 1, 40)), 0.125)
    assert not ka.dense_supports((3, 8, 1, 64), k.astype(mx.int32), None, 0.125)
    assert not ka.dense_supports((3, 8, 1, 512), mx.zeros((3, 2, 40, 512)), None, 0.1)


def test_only_masked_dense_calls_reach_the_kernel(monkeypatch):
    """MLX's attention is slow only with a mask array (a padded batch): unmasked calls
    stay on it, so the load check compiles (and checks) the masked kernel alone."""
    monkeypatch.setattr(ka, "cuda_backend", lambda: True)
    seen = []

    def kernel(q, k, v, scale, mask):
        seen.append(mask is not None)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(ka, "_dense_cuda", kernel)
    q, k = mx.ones((2, 4, 1, 32)), mx.ones((2, 2, 9, 32))
    ka._dense(q, k, k, 0.125, None)
    ka._dense(q, k, k, 0.125, "causal")
    assert seen == []
    ka._dense(q, k, k, 0.125, mx.array([0, 3])[:, None, None, None] <= mx.arange(9))
    assert seen == [True]
    assert ka.self_check_dense([(4, 2, 32, mx.float32, mx.float32, 0.125)]) is None
    assert seen == [True, True]
