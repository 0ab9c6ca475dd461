"""Decode attention over a quantized KV cache, kernel only: microseconds per layer call.

One layer's attention of one query token per row over S cached tokens, as a decode
step runs it, at each batch size B:

  bf16      mx.fast.scaled_dot_product_attention on a full-precision cache
  dense     kv_attention.dense_attention on the same cache: the fused kernel reading
            bf16 keys (what the engine runs for padded batches on CUDA)
  deq<b>    dequantize the b-bit cache, then the same (the engine's fallback)
  fused<b>  kv_attention.decode_attention: the fused kernel on CUDA (elsewhere the
            same math in MLX ops, which is not meant to be fast)

Each call is timed over --iters calls on distinct query tensors evaluated together
(one graph), median of --rounds. Also: each fused case's largest error against the
dequantized path, and the load-time self-check's verdict at these shapes.

  python -m bench kv-attention --quick
  python -m bench kv-attention --shapes llama1b,qwen3_5 --batch 8,32,128 --context 2048
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx

from mlxnb.core.worker import kv_attention as ka

from . import common
from .common import log, median

NAME, RESULT, TITLE = "kv-attention", "kv-attention", "Decode attention on quantized KV"

# (query heads, KV heads, head dim) of the models' attention layers
SHAPES = {"llama1b": (32, 8, 64), "qwen3_5": (8, 2, 256), "lfm2": (32, 8, 64),
          "smollm2": (9, 3, 64)}


def _time(fn, iters, rounds):
    outs = fn()  # warm: compile, allocate
    mx.eval(outs)
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append((time.perf_counter() - t) / iters * 1e6)
    return median(ts)


def one(shape, B, S, bits_list, gs, dtype, iters, rounds, masked):
    Hq, Hkv, D = SHAPES[shape]
    scale = D ** -0.5
    ks = mx.random.split(mx.random.key(0), 3)
    qs = [mx.random.normal((B, Hq, 1, D), key=k).astype(dtype)
          for k in mx.random.split(ks[0], iters)]
    k = mx.random.normal((B, Hkv, S, D), key=ks[1]).astype(dtype)
    v = mx.random.normal((B, Hkv, S, D), key=ks[2]).astype(dtype)
    mask = None
    if masked:  # left padding: row i skips its first i keys
        mask = mx.arange(B)[:, None, None, None] <= mx.arange(S)
    mx.eval(qs, k, v)
    row = dict(shape=shape, B=B, S=S, masked=masked)
    row["bf16"] = _time(lambda: [mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask) for q in qs], iters, rounds)
    try:
        row["dense"] = _time(lambda: [ka.dense_attention(q, k, v, scale, mask) for q in qs],
                             iters, rounds)
        got = ka.dense_attention(qs[0], k, v, scale, mask).astype(mx.float32)
        want = mx.fast.scaled_dot_product_attention(qs[0], k, v, scale=scale, mask=mask)
        row["err_dense"] = (got - want.astype(mx.float32)).abs().max().item()
    except Exception as e:
        row["dense"] = None
        row["error_dense"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        log(f"  dense kernel failed: {row['error_dense']}")
    for bits in bits_list:
        kq = ka.FusedKV(mx.quantize(k, group_size=gs, bits=bits))
        vq = ka.FusedKV(mx.quantize(v, group_size=gs, bits=bits))
        mx.eval(kq, vq)
        row[f"deq{bits}"] = _time(lambda: [ka.dequantized_attention(
            q, kq, vq, scale, mask, gs, bits) for q in qs], iters, rounds)
        if not ka.kernel_supports(qs[0].shape, kq, gs, bits, mask, scale):
            row[f"fused{bits}"] = None
            continue
        try:
            row[f"fused{bits}"] = _time(lambda: [ka.decode_attention(
                q, kq, vq, scale, mask, gs, bits) for q in qs], iters, rounds)
            got = ka.decode_attention(qs[0], kq, vq, scale, mask, gs, bits)
            want = ka.dequantized_attention(qs[0], kq, vq, scale, mask, gs, bits)
            row[f"err{bits}"] = (got.astype(mx.float32) - want.astype(mx.float32)
                                 ).abs().max().item()
        except Exception as e:
            row[f"fused{bits}"] = None
            row[f"error{bits}"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            log(f"  fused {bits}-bit failed: {row[f'error{bits}']}")
        del kq, vq
    mx.clear_cache()
    return row


def table(rows, bits_list, args):
    full = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    head = ["shape", "B", "mask", f"{full} us", "dense us", f"dense/{full}", "max err dense"]
    for b in bits_list:
        head += [f"deq{b} us", f"fused{b} us", f"fused{b}/{full}", f"max err {b}"]
    out = [f"## One layer's decode attention, context {args.context}, group {args.group}, "
           f"{args.dtype} (us per call, median of {args.rounds} x {args.iters} calls)", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    for r in rows:
        dn = r.get("dense")
        cells = [r["shape"], str(r["B"]), "left-pad" if r["masked"] else "-", f(r["bf16"]),
                 f(dn), f(dn / r["bf16"], 2) if dn else "-",
                 f"{r['err_dense']:.2g}" if "err_dense" in r else
                 r.get("error_dense", "-")[:60]]
        for b in bits_list:
            fu = r.get(f"fused{b}")
            cells += [f(r[f"deq{b}"]), f(fu), f(fu / r["bf16"], 2) if fu else "-",
                      f"{r[f'err{b}']:.2g}" if f"err{b}" in r else
                      r.get(f"error{b}", "-")[:60]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shapes", default=["llama1b", "qwen3_5"], type=common.names(list(SHAPES)))
    ap.add_argument("--batch", default=[8, 32, 128], type=common.counts)
    ap.add_argument("--context", type=common.count, default=2048)
    ap.add_argument("--bits", default=["4", "8"], type=common.names(["4", "8"]))
    ap.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=common.count, default=16)
    ap.add_argument("--rounds", type=common.count, default=7)
    ap.add_argument("--no-mask", action="store_true", help="skip the left-padded cases")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        common.quick(ap, args, argv, batch=[2], context=64, iters=2, rounds=2, dtype="float32")
    bits_list = [int(b) for b in args.bits]
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# kv-attention  {report.env}  cuda kernel: {ka.cuda_backend()}")
    dtype = getattr(mx, args.dtype)
    rows = []
    for shape in args.shapes:
        for B in args.batch:
            for masked in (False,) if args.no_mask else (False, True):
                rows.append(one(shape, B, args.context, bits_list, args.group, dtype,
                                args.iters, args.rounds, masked))
                log("  " + str({k: (round(v, 1) if isinstance(v, float) else v)
                                for k, v in rows[-1].items()}))
    calls = [(*SHAPES[s], dtype, dtype, SHAPES[s][2] ** -0.5, args.group, b)
             for s in args.shapes for b in bits_list]
    verdict = ka.self_check(calls)
    kernel = ka._QUANT[0].__name__
    dense = ka.self_check_dense([c[:5] + (c[5],) for c in calls])
    text = (table(rows, bits_list, args) + "\n\n"
            + f"Path: {'fused CUDA kernels' if ka.cuda_backend() else 'MLX ops (not CUDA)'}; "
            + f"load-time self-checks at these shapes: quantized "
            + f"{verdict or 'passed (' + kernel + ')'}, dense {dense or 'passed'}.")
    log("\n" + text)
    report.write(text, dict(rows=rows, self_check=verdict, kernel=kernel, dense=dense))
    return 0
