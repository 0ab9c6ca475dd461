"""What a verification forward costs by width, with every call synchronous.

Speculative decoding pays where verifying W positions of a row costs little more than
decoding one. On a host-bound GPU that depends on how the backend launches the
forward's matmuls, which this measures apart from the engine:

  matmul M      a chain of --chain dependent [1, M, d] @ [f, d].T matmuls (as a linear
                layer runs; --dims, default SmolLM2's MLP): host graph build and
                eval, microseconds per matmul; "M one-row matmuls" is the same rows
                as a batch of one-row matmuls, "rows GEMV" worker/rows_gemv.py's
                kernel (CUDA, where its check passes), "gathered GEMV" the same rows
                through mx.gather_mm (rows_gemv.gathered)
  forward W     the model's forward of W positions on a KV cache of --prompt tokens,
                trimmed back after each call (the cache grows by one per call, as a
                decode does); multi-position attention as verification runs it
                (worker/wideattn.py), then on CUDA with worker/wide_kernel.py's
                attention and with the rows GEMV too; median build and eval ms of
                --calls calls, the first --skip (first uses) left out
  rollback B    after a verification, the per-row roll of a --batch-row cache of
                the model (rows of --prompt tokens and more) that drops each row's
                rejected positions (0, 1, 2, ... a row): worker/rollback.py's gather
                of [D] vectors against an element gather (mlx-lm's dynamic_roll),
                median ms of --calls

  python -m bench verify-cost --quick
  python -m bench verify-cost --model default --widths 1,2,5,8
"""

from __future__ import annotations

import argparse
import os
import sys

from . import common  # first: mlxnb puts OpenBLAS under MLX on a Linux CPU
from .common import log, median, pc

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

NAME, RESULT, TITLE = "verify-cost", "verify-cost", "A verification forward's cost by width"


def _sync_ms(build):
    """(build ms, eval ms) of one call: the graph built by `build()`, then evaluated."""
    mx.synchronize()
    t0 = pc()
    out = build()
    t1 = pc()
    mx.eval(out)
    return 1e3 * (t1 - t0), 1e3 * (pc() - t1)


def matmul_rows(ms, n, dtype, d=576, f=1536, reps=4):
    """Per M and way: (build us, eval us) per matmul in a chain of n: [1, M, d] as one
    matmul, [M, 1, d] as M one-row matmuls, and [M, d] by the rows GEMV kernel."""
    from mlxnb.core.worker import rows_gemv

    w1 = (mx.random.normal((f, d)) * d ** -0.5).astype(dtype)  # [out, in], as nn.Linear
    w2 = (mx.random.normal((d, f)) * f ** -0.5).astype(dtype)
    gemv = KERNEL[0] and rows_gemv.check([(f, d), (d, f)], dtype) is None
    gather = dtype == mx.float32 or rows_gemv._backend_ok() is None  # (CPU: float32 only)
    rows = []
    for M in ms:
        ways = ["one"] + (["batched"] if M > 1 else []) + (
            ["gemv"] if gemv and 1 < M <= rows_gemv.MAX_ROWS else []) + (
            ["gather"] if gather and M > 1 else [])
        for way in ways:
            shape = {"one": (1, M, d), "batched": (M, 1, d), "gemv": (M, d),
                     "gather": (M, d)}[way]
            x = mx.random.normal(shape).astype(dtype)
            mx.eval(w1, w2, x)

            def chain():
                y = x
                for _ in range(n // 2):
                    if way == "gemv":
                        y = rows_gemv.matmul(rows_gemv.matmul(y, w1), w2)
                    elif way == "gather":
                        y = rows_gemv.gathered(rows_gemv.gathered(y, w1), w2)
                    else:
                        y = (y @ w1.T) @ w2.T
                return y

            b, e = zip(*[_sync_ms(chain) for _ in range(reps)])
            rows.append(dict(M=M, way=way, build_us=1e3 * median(b[1:]) / n,
                             eval_us=1e3 * median(e[1:]) / n))
    return rows


def forward_widths(model, widths, prompt, calls, skip):
    """Each width with MLX's matmuls and the composed attention, then (where its
    check passes: CUDA) with wide_kernel.py's attention, then (where rows_gemv
    installs) with the rows GEMV kernel too."""
    from mlxnb.core.worker import kv_attention, rows_gemv, wideattn

    rows = _forward_widths(model, widths, prompt, calls, skip, "MLX")
    attn = model.layers[0].self_attn
    Hq, Hkv = attn.n_heads, attn.n_kv_heads
    dtype = attn.q_proj.weight.dtype
    why = (kv_attention.self_check_wide(
        [(Hq, Hkv, attn.q_proj.weight.shape[0] // Hq, dtype, dtype, float(attn.scale))])
        if kv_attention.cuda_backend() else "not CUDA")
    log(f"wide attention kernel: {why or 'checked'}")
    if not why:
        wideattn.use_kernel(True)
        rows += _forward_widths(model, [w for w in widths if w > 1], prompt, calls, skip,
                                "attention kernel")
    note = (rows_gemv.install(model, on=True) if KERNEL[0]
            else "MLX's matmul (--no-rows-kernel)")
    for r in rows:
        r["linears"] = note
    if note.startswith("kernel"):
        rows += _forward_widths(model, [w for w in widths if w > 1], prompt, calls, skip,
                                "rows GEMV" + (" + attention kernel" if not why else ""))
    os.environ["MLXNB_ROWS_GEMV"] = "gather"
    gnote = rows_gemv.install(model, on=True)
    log(f"gathered GEMV: {gnote}")
    if gnote.startswith("gathered"):
        rows += _forward_widths(model, [w for w in widths if w > 1], prompt, calls, skip,
                                "gathered GEMV" + (" + attention kernel" if not why else ""))
    os.environ.pop("MLXNB_ROWS_GEMV")
    rows_gemv.install(model, on=False)
    wideattn.use_kernel(False)
    return rows


def _forward_widths(model, widths, prompt, calls, skip, way):
    from mlxnb.core.worker import tokens
    from mlxnb.core.worker.wideattn import wide_attention

    ids = tokens.ids([[2 + (7 * i) % 50 for i in range(prompt)]])
    rows = []
    for W in widths:
        cache = make_prompt_cache(model)
        mx.eval(model(ids, cache=cache))
        got = []
        for i in range(calls):
            inp = tokens.ids([[3 + (i + j) % 40 for j in range(W)]])

            def fwd():
                if W == 1:
                    return model(inp, cache=cache)
                with wide_attention():
                    return model(inp, cache=cache)

            got.append(_sync_ms(fwd))
            for c in cache:
                c.trim(W - 1)
        b, e = zip(*got[skip:])
        rows.append(dict(W=W, way=way, build_ms=median(b), eval_ms=median(e),
                         first_ms=sum(got[0]), linears=""))
    return rows


def rollback_cost(model, B, prompt, calls):
    """(rows gather ms, element gather ms): median of `calls` rollbacks of a B-row
    batch cache, every layer's keys and values evaluated."""
    from mlx_lm.models.cache import dynamic_roll

    from mlxnb.core.worker.caches import leaves, merge_lean
    from mlxnb.core.worker.rollback import rollback

    rows = []
    for b in range(B):  # rows of different lengths: left padding, as a batch has
        c = make_prompt_cache(model)
        model(mx.array([[(7 * i + b) % 500 + 10 for i in range(prompt + 3 * b)]]), cache=c)
        rows.append(c)
    caches = merge_lean([[r[i] for r in rows] for i in range(len(rows[0]))])
    rejected = [b % 4 for b in range(B)]  # min 0: the write index stays
    shift = mx.array(rejected)[:, None]

    def ours():
        rollback(caches, rejected)
        return [x for c in leaves(caches) for x in (c.keys, c.values)]

    def element():
        out = []
        for c in leaves(caches):
            i = c._idx
            c.keys[..., :i, :] = dynamic_roll(c.keys[..., :i, :], shift, axis=2)
            c.values[..., :i, :] = dynamic_roll(c.values[..., :i, :], shift, axis=2)
            out += [c.keys, c.values]
        return out

    return tuple(median([sum(_sync_ms(f)) for _ in range(calls)][1:]) for f in (ours, element))


KERNEL = [True]  # --no-rows-kernel: leave out rows_gemv's kernel (its NVRTC compiles)
WAYS = {"one": "one matmul", "batched": "M one-row matmuls", "gemv": "rows GEMV kernel",
        "gather": "gathered GEMV (gather_mm)"}


def render(mms, fw, rb, args) -> str:
    L = []
    for (d, f), mm in mms:
        L += [f"Matmuls [rows, {d}] @ [{f}, {d}].T and back, {args.chain} chained, "
              f"{args.dtype}:", "",
              "| rows M | as | build us/matmul | eval us/matmul |", "|---|---|---|---|"]
        L += [f"| {r['M']} | {WAYS[r['way']]} | {r['build_us']:.1f} | {r['eval_us']:.1f} |"
              for r in mm]
        L.append("")
    L += [f"Forward of W positions, model `{args.model}` ({args.dtype}), cache of "
          f"{args.prompt} tokens, {args.calls} calls (first {args.skip} left out); "
          f"linears: {fw[0]['linears']}:", "",
          "| W | kernels | build ms | eval ms | total ms | x W=1 | first call ms |",
          "|---|---|---|---|---|---|---|"]
    one = next((r["build_ms"] + r["eval_ms"] for r in fw if r["W"] == 1), None)
    for r in fw:
        t = r["build_ms"] + r["eval_ms"]
        L.append(f"| {r['W']} | {r['way']} | {r['build_ms']:.2f} | {r['eval_ms']:.2f} | "
                 f"{t:.2f} | {t / one:.2f} | {r['first_ms']:.1f} |" if one else "")
    if args.batch:
        rows_ms, element_ms = rb
        L += ["", f"Rollback of a {args.batch}-row batch cache ({args.prompt}+ tokens a row), "
              f"median of {args.calls}: rows gather (the engine's) {rows_ms:.1f} ms, "
              f"element gather (dynamic_roll) {element_ms:.1f} ms."]
    return "\n".join(L)


def _dims(text: str):
    """--dims: d x f matmul shapes, comma-separated (576x1536,2048x8192)."""
    try:
        out = [tuple(common.count(v) for v in p.split("x")) for p in text.split(",")]
        if all(len(d) == 2 for d in out):
            return out
    except argparse.ArgumentTypeError:
        pass
    raise argparse.ArgumentTypeError(f"takes d x f shapes, comma-separated (as 576x1536), "
                                     f"got {text!r}")


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--model", default="default", help="'default' or a bench shape")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", default=[1, 2, 3, 5, 8, 16], type=common.counts,
                    help="matmul rows M")
    ap.add_argument("--chain", type=common.count, default=200)
    ap.add_argument("--dims", default=[(576, 1536)], type=_dims,
                    help="matmul shapes d x f, comma-separated")
    ap.add_argument("--widths", default=[1, 2, 5, 8], type=common.counts)
    ap.add_argument("--prompt", type=common.count, default=100)
    ap.add_argument("--calls", type=common.count, default=15)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="rows of the rollback (0: none)")
    ap.add_argument("--no-rows-kernel", action="store_true",
                    help="leave out the rows GEMV kernel (its NVRTC compiles take minutes)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        given = common.quick(ap, args, argv, model="tiny", dtype="float32", rows=[1, 2],
                             chain=8, widths=[1, 3], calls=4, skip=1, prompt=16, batch=3)
        if "skip" not in given:  # quick's sizes fit the ones given
            args.skip = min(args.skip, args.calls - 1)
    if args.calls < 2:
        ap.error(f"argument --calls: takes 2 or more (the rollback's first is a warm-up), "
                 f"got {args.calls}")
    if not 0 <= args.skip < args.calls:
        ap.error(f"argument --skip: takes 0 or more calls, fewer than --calls ({args.calls}); "
                 f"got {args.skip}")
    if args.batch < 0:
        ap.error("argument --batch: takes a batch size, or 0 for no rollback")
    if args.model not in ["default"] + list(common.SHAPES):
        ap.error(f"argument --model: takes default or one of {', '.join(common.SHAPES)}")
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# verify-cost  {report.env}")
    dtype = getattr(mx, args.dtype)
    KERNEL[0] = not args.no_rows_kernel
    ms = args.rows
    dims = args.dims
    mm = [((d, f), matmul_rows(ms, args.chain, dtype, d, f)) for d, f in dims]
    if args.model == "default":
        from mlxnb.models.loading import load_model

        model = load_model("default")[0]
        model.set_dtype(dtype)
    else:
        model = common.build_model(args.model, args.dtype)[0]
    fw = forward_widths(model, args.widths, args.prompt,
                        args.calls, args.skip)
    rb = rollback_cost(model, args.batch, args.prompt, args.calls) if args.batch else None
    text = render(mm, fw, rb, args)
    print(text)
    report.write(text, dict(matmul=mm, forward=fw, rollback_ms=rb))
    return 0
