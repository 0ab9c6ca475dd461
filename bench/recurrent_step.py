"""One recurrent decoder layer's decode step at a real model's width: mlx-lm's code vs
the engine's compiled step (recurrent.py), and the gated delta rule alone.

  layer   Qwen3.5-0.8B's gated delta-net layer and LFM2-1.2B's short-conv layer (random
          weights): host us to build one step's graph, and us per step with --iters
          steps evaluated together, for plain / compiled with each recurrence mode
  rule    the gated delta recurrence alone for one token: mlx-lm's ops, this
          package's CUDA kernel, mx.fast.gated_delta_update; us per call and the
          largest difference from the ops
  prompt  the gated delta recurrence over a prompt chunk of --prompt tokens (one row
          left-padded): mlx-lm's loop of per-token steps vs this package's prefill
          kernel (gated_delta_prefill.py, CUDA); ms per call and the largest
          difference from mlx-lm's, relative to the largest value

  python -m bench recurrent-step --quick
  python -m bench recurrent-step --batch 8,32,128
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlxnb.core.worker import gated_delta, recurrent

from . import common
from .cache_kinds import build_hybrid
from .common import log, median

NAME, RESULT, TITLE = "recurrent-step", "recurrent-step", "Recurrent layers' decode step"


def _layer(model):
    cache = make_prompt_cache(model)
    i = next(i for i, c in enumerate(cache) if type(c) is ArraysCache)
    return model.layers[i], cache[i], i


def _time(fn, iters, rounds):
    mx.eval(fn())
    build, total = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = [fn() for _ in range(iters)]
        t1 = time.perf_counter()
        mx.eval(outs)
        build.append((t1 - t) / iters * 1e6)
        total.append((time.perf_counter() - t) / iters * 1e6)
    return median(build), median(total)


def layer_rows(name, B, args):
    rows = []
    model = build_hybrid(name, args.dtype, args.size)[0]
    layer, c, i = _layer(model)
    hidden = model.args.hidden_size if hasattr(model.args, "hidden_size") else \
        model.args.text_config["hidden_size"]
    dtype = getattr(mx, args.dtype)
    x = mx.random.normal((B, 1, hidden)).astype(dtype)
    prompt = mx.random.randint(2, 100, (B, 8))
    full = make_prompt_cache(model)
    model(prompt, cache=full)  # a state to step from
    state = list(full[i].cache)
    mx.eval(x, state)

    def plain():
        cc = ArraysCache(len(state))
        cc.cache = list(state)
        return layer(x, mask=None, cache=cc)

    b, t = _time(plain, args.iters, args.rounds)
    rows.append(dict(shape=name, B=B, path="mlx-lm", build=b, total=t))
    modes = gated_delta.MODES if name.startswith("qwen") else ("ops",)
    gated_delta.install()
    for mode in modes:
        recurrent.compile_recurrent(model, full, lambda: True, mode)
        try:
            b, t = _time(plain, args.iters, args.rounds)
            rows.append(dict(shape=name, B=B, path=f"compiled ({mode})", build=b, total=t))
        except Exception as e:
            rows.append(dict(shape=name, B=B, path=f"compiled ({mode})", build=None,
                             total=None, error=f"{type(e).__name__}: {str(e)[:120]}"))
        recurrent.uncompile(model)
    return rows


def rule_rows(B, args):
    """The recurrence alone at Qwen3.5-0.8B's sizes (16 heads of 128 x 128)."""
    from mlx_lm.models.gated_delta import gated_delta_ops
    dtype = getattr(mx, args.dtype)
    H, D = (2, 32) if args.quick else (16, 128)
    ks = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((B, 1, H, D), key=ks[0]).astype(dtype)
    k = (mx.random.normal((B, 1, H, D), key=ks[1]) * D ** -0.5).astype(dtype)
    v = mx.random.normal((B, 1, H, D), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (B, 1, H), key=ks[3])
    beta = mx.random.uniform(shape=(B, 1, H), key=ks[4]).astype(dtype)
    st = mx.random.normal((B, H, D, D), key=ks[5]) * 0.1
    mx.eval(q, k, v, g, beta, st)
    want = gated_delta_ops(q, k, v, g, beta, st)
    out = []
    for name, fn in (("ops", lambda: gated_delta_ops(q, k, v, g, beta, st)),
                     ("kernel", lambda: gated_delta.decode_step(q, k, v, g, beta, st)),
                     ("mx.fast", lambda: tuple(mx.fast.gated_delta_update(q, k, v, g, beta,
                                                                          st)))):
        try:
            b, t = _time(fn, args.iters, args.rounds)
            got = fn()
            err = max((a.astype(mx.float32) - w.astype(mx.float32)).abs().max().item()
                      for a, w in zip(got, want))
            out.append(dict(B=B, path=name, build=b, total=t, err=err))
        except Exception as e:
            out.append(dict(B=B, path=name, build=None, total=None, err=None,
                            error=f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"))
        log("  " + str(out[-1]))
    return out


def prompt_rows(B, args):
    """The recurrence over args.prompt tokens at Qwen3.5-0.8B's sizes, gates from the
    raw projections as the layer gives them."""
    from mlx_lm.models.gated_delta import gated_delta_update

    from mlxnb.core.worker import gated_delta_prefill as gdp

    H, D = (2, 32) if args.quick else (16, 128)
    key = (args.dtype, H, H, D, D)
    A_log, dt_bias = mx.random.normal((H,)), mx.random.normal((H,))
    one = gdp._inputs(key, A_log, dt_bias, T=args.prompt)  # three rows, one padded
    rows = [mx.concatenate([x] * -(-B // 3))[:B] if x.ndim and x.shape[0] == 3 else x
            for x in one]
    mask = rows[-1]
    mx.eval(rows)
    want = gated_delta_update(*rows, use_kernel=False)
    out = []
    for name, fn in (("mlx-lm (a step per token)",
                      lambda: gated_delta_update(*rows, use_kernel=False)),
                     ("kernel", lambda: gdp.prefill(*rows))):
        try:
            _, t = _time(fn, max(1, args.iters // 4), args.rounds)
            y, st = fn()
            keep = mask[..., None, None]
            errs = [(mx.where(keep, a.astype(mx.float32), 0) - mx.where(
                keep, w.astype(mx.float32), 0)).abs().max().item()
                / max(w.astype(mx.float32).abs().max().item(), 1e-9)
                for a, w in ((y, want[0]),)]
            errs.append((st - want[1]).abs().max().item() / max(
                want[1].abs().max().item(), 1e-9))
            out.append(dict(B=B, T=args.prompt, path=name, ms=t / 1e3, y=errs[0], state=errs[1]))
        except Exception as e:
            out.append(dict(B=B, T=args.prompt, path=name, ms=None, y=None, state=None,
                            error=f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"))
        log("  " + str(out[-1]))
    return out


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shapes", default=["qwen3_5-0.8b", "lfm2-1.2b"],
                    type=common.names(["qwen3_5-0.8b", "lfm2-1.2b"]))
    ap.add_argument("--batch", default=[8, 32, 128], type=common.counts)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=common.count, default=20)
    ap.add_argument("--rounds", type=common.count, default=5)
    ap.add_argument("--prompt", type=common.count, default=512,
                    help="tokens of the prompt part's chunk")
    ap.add_argument("--quick", action="store_true", help="smoke run: toy width, seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    args.size = None
    if args.quick:
        args.size = "quick"
        common.quick(ap, args, argv, dtype="float32", batch=[2], iters=2, rounds=2,
                     prompt=8)
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# recurrent-step  {report.env}")
    rows, rules, prompts = [], [], []
    for B in args.batch:
        for name in args.shapes:
            rows += layer_rows(name, B, args)
            log("  " + str(rows[-1]))
        rules += rule_rows(B, args)
        prompts += prompt_rows(B, args)

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    text = ["## One recurrent layer's decode step (us; build = graph construction on the "
            f"host; total = build + device, {args.iters} steps evaluated together, "
            f"median of {args.rounds})", "", "| shape | B | path | build us | total us |",
            "|---|---|---|---|---|"]
    text += [f"| {r['shape']} | {r['B']} | {r['path']} | {f(r['build'])} | "
             f"{f(r['total'])}{' ' + r['error'] if r.get('error') else ''} |" for r in rows]
    text += ["", "## The gated delta rule alone, one token (Qwen3.5-0.8B: 16 heads, "
             "128 x 128 state)", "", "| B | path | build us | total us | max diff vs ops |",
             "|---|---|---|---|---|"]
    for r in rules:
        err = "-" if r["err"] is None else f"{r['err']:.2g}"
        text.append(f"| {r['B']} | {r['path']} | {f(r['build'])} | {f(r['total'])} | {err}"
                    f"{' ' + r['error'] if r.get('error') else ''} |")
    text += ["", f"## The gated delta rule over a prompt chunk ({args.prompt} tokens, "
             "one row of three left-padded; Qwen3.5-0.8B's sizes)", "",
             "| B | path | ms per call | y: max diff / max | state: max diff / max |",
             "|---|---|---|---|---|"]
    for r in prompts:
        e = ["-" if r[k] is None else f"{r[k]:.2g}" for k in ("y", "state")]
        text.append(f"| {r['B']} | {r['path']} | {f(r['ms'], 2)} | {e[0]} | {e[1]}"
                    f"{' ' + r['error'] if r.get('error') else ''} |")
    out = "\n".join(text)
    log("\n" + out)
    report.write(out, dict(layers=rows, rule=rules, prompt=prompts))
    return 0
