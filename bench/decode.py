"""Decode tok/s: a bare MLX loop vs mlx-lm's BatchGenerator vs mlxnb's Engine.

One process, random-weight llama shapes, the same random prompts for every method
(no EOS: every row runs to max_tokens, checked). Each (method, B) is warmed up once
on other prompts. With --repeat N the methods interleave in N rounds on the same
prompts per round; columns are each method's best round and "med" the median over
rounds of the per-round ratio, which the machine's drift disturbs least.

  raw       forward on a plain mlx-lm KV cache + argmax, step N+1 launched
            (mx.async_eval) before step N is read: B * new / decode time
  rawb      the same on mlx-lm's BatchKVCache (per-row offsets, array mask), no
            padding: raw -> rawb is the batch cache's cost, rawb -> engine the engine's
  bg        BatchGenerator, all B inserted at once, completion = prefill batch = B:
            its stats().generation_tps
  engine    Engine(max_batch=B, kv_budget=None) on a twin of the model (same
            weights; it fuses projections in place), all B rows at once:
            tokens / summed step time over the steps with all B rows decoding and
            no prefill; eng-span: the same tokens over those steps' wall span;
            eng-long: a second run with max_tokens = new + B (longer caches: past
            256 tokens once prompt + new + B is)
diagnostics (printed under the table with their median ratios):
  rawv, rawt, rawvt   raw on the engine's cache views / on a fresh thread / both
  bgd       BatchGenerator's own batch sizes (completion 32, prefill 8)
  engine0   Engine(streak_s=0): one decode step per tick
  enginenf  Engine(fuse=False): mlx-lm's projections as loaded

--profile B: where the engine's time goes per decode step at batch B (its timing
hooks, Engine(streak_s=0)), beside the raw loop's split.

  python -m bench decode --quick
  python -m bench decode --shape smollm2 --dtype float32 --batch 1,8,32 --new 32
  python -m bench decode --plan "smollm2:bfloat16:1,8,32,128 llama1b:bfloat16:8,128" \\
      --repeat 5 --warm-new 128 --no-long --profile 32 --save
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

import mlxnb

from . import common
from .common import fmt, log, pc
from .tracing import EngineProfiler, GcTimer, format_profile

NAME, RESULT, TITLE = "decode", "engine-decode", "Decode tok/s: raw MLX vs BatchGenerator vs mlxnb"
RAW = {"raw": {}, "rawb": dict(batch_cache=True), "rawv": dict(views=True)}
# engine variants: method -> (environment variable, value, what it changes)
VARIANTS = {
    "engineg": ("MLXNB_ROWS_GEMV", "gather", "the gathered GEMV on every few-row product"),
    "enginew": ("MLXNB_LEAN_WINDOWS", "0", "mlx-lm's window bookkeeping on every write"),
    "enginec": ("MLXNB_CONV_KERNEL", "0", "short convs (and the delta-net q/k norms) as "
                "MLX ops, not in the kernels"),
    "engineq": ("MLXNB_QK_ROPE", "0", "one-token q/k norms and RoPE as MLX ops"),
}
DIAGNOSTIC = ("bgd", "rawt", "rawv", "rawvt", "engine0", "enginenf")
# (mine, other): per-round ratios kept as <mine>_over_<other>_median
PAIRS = [("engine", "raw"), ("engine", "bg"), ("engine", "bgd"), ("rawt", "raw"),
         ("rawv", "raw"), ("rawvt", "raw"), ("engine0", "raw"), ("enginenf", "raw")]


def engine_kw(args) -> dict:
    kw = dict(warmup=not args.no_warmup, fuse=not args.no_fuse)
    if args.streak_s is not None:
        kw["streak_s"] = args.streak_s
    return kw


async def run_engine(model, tok, prompts, prompts_long, n, B, warm, warm_n, kw,
                     prof=None, long=True):
    if prof is not None:
        kw = dict(kw, streak_s=0.0)
    eng = mlxnb.Engine((model, tok), max_batch=B, kv_budget=None, **kw)
    try:
        await common.engine_run(eng, warm, warm_n)
        if prof is not None:
            prof.attach(eng)
        res, steps, wall, ok = await common.engine_run(eng, prompts, n)
        if prof is not None:
            prof.detach(eng)
        w = common.decode_window(steps, B)
        st = None
        if long:
            _, steps2, _, ok2 = await common.engine_run(eng, prompts_long, n + B)
            st, ok = common.decode_window(steps2, B), ok and ok2
        ttft = [r.ttft_s for r in res]
        if prof is not None:
            prof.summarize(steps, B)
        return dict(
            decode_tps=w["tps"] if w else 0.0, span_tps=w["span_tps"] if w else 0.0,
            natural_full_steps=w["nsteps"] if w else 0, natural_steps=len(steps),
            split_ms=w["split_ms"] if w else (), join_ticks=common.join_ticks(steps),
            e2e_tps=B * n / wall, wall_s=wall, ok=ok,
            steady_decode_tps=st["tps"] if st else None,
            steady_steps=st["nsteps"] if st else 0,
            ttft_mean_s=statistics.mean(ttft), ttft_max_s=max(ttft))
    finally:
        await eng.aclose()


async def measure(meth, rep, model, twin, tok, args, B, warm, p1, p2):
    """One measurement of one method (warmed up on `warm` in round 0)."""
    if meth in RAW or meth in ("rawt", "rawvt"):
        kw = RAW[meth[:-1] if meth in ("rawt", "rawvt") else meth]

        def both():
            if rep == 0:
                common.run_raw(model, warm, args.warm_new, **kw)
            return common.run_raw(model, p1, args.new, **kw)
        if meth in RAW:
            return both()
        # MLX keeps streams (and CUDA kernel state) per thread: a fresh one starts cold
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(both).result()
    if meth in ("bg", "bgd"):
        if rep == 0:
            common.run_bg(model, warm, args.warm_new, defaults=meth == "bgd")
        return common.run_bg(model, p1, args.new, defaults=meth == "bgd")
    if meth in VARIANTS:  # the engine with one setting changed through its environment
        var, value, _ = VARIANTS[meth]
        before = os.environ.get(var)
        os.environ[var] = value  # read by the Engine's load
        try:
            return await measure("engine", rep, model, twin, tok, args, B, warm, p1, p2)
        finally:
            if before is None:
                os.environ.pop(var)
            else:
                os.environ[var] = before
    if meth in ("engine", "engine0", "enginenf"):
        kw = engine_kw(args)
        if meth == "engine0":
            kw["streak_s"] = 0.0
        if meth == "enginenf":
            kw["fuse"] = False
        return await run_engine(twin if kw["fuse"] else model, tok, p1, p2, args.new, B,
                                warm, args.warm_new, kw,
                                long=not args.no_long and meth == "engine")
    raise ValueError(f"unknown method {meth!r}")


async def do_profile(model, twin, tok, rng, args, B, vocab):
    log(f"## profile at B={B}")
    try:
        warm, p1, p2, p3 = (common.make_prompts(rng, B, args.prompt, vocab)
                            for _ in range(4))
        raw = {}
        common.run_raw(model, warm, args.warm_new)
        common.run_raw(model, p1, args.new, prof=raw)
        raw.update(common.run_raw_sync(model, p1, min(args.new, 32)))
        prof = EngineProfiler()
        kw = engine_kw(args)
        with GcTimer() as g:
            eng = await run_engine(twin if kw["fuse"] else model, tok, p2, p3, args.new,
                                   B, warm, args.warm_new, kw, prof=prof)
        eng["gc_ms_all_runs"] = g.ms
        if prof.summary is None:
            raise RuntimeError("no steady ticks to profile")
        text = (format_profile(prof.summary, raw, B, args.new)
                + f"\nPython GC during the engine's three runs: {g.ms:.1f} ms.")
        log(text)
        return dict(engine=prof.summary, raw=raw, engine_run=eng, text=text)
    except Exception as e:
        traceback.print_exc()
        return dict(error=f"{type(e).__name__}: {e}")


def render(results):
    a = results["args"]
    L = [f"prompt {a['prompt']} tokens, {a['new']} new tokens, greedy, random weights", "",
         "Decode tok/s (prefill excluded). engine = tokens / sum(dt_s) over steps with all B "
         "rows decoding and no prefill; eng-span = same over their wall span; e2e = B*new / "
         "wall of a plain run (prefill, ramp-up, loop included); eng-long = engine over "
         "B+new tokens per row (longer caches: past 256 tokens where prompt+new+B is). "
         "Columns are the best of --repeat "
         "rounds; 'med' = median over rounds of the per-round ratio (methods interleave "
         "within a round, on the same prompts).", "",
         "| shape | dtype | B | raw | raw-bkv | BG | engine | eng-span | engine/BG |"
         " engine/raw | eng-span/raw | raw e2e | BG e2e | engine e2e | eng-long |"
         " engine/BG med | engine/raw med |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(x, y):
        return f"{x / y:.2f}" if x and y else "-"

    for r in results["rows"]:
        raw, rawb, bg, e = (r.get(m) or {} for m in ("raw", "rawb", "bg", "engine"))
        en, sp, rt = e.get("decode_tps"), e.get("span_tps"), raw.get("decode_tps")
        L.append(f"| {r['shape']} | {r['dtype']} | {r['B']} | {fmt(rt)} | "
                 f"{fmt(rawb.get('decode_tps'))} | {fmt(bg.get('decode_tps'))} | {fmt(en)} | "
                 f"{fmt(sp)} | {ratio(en, bg.get('decode_tps'))} | {ratio(en, rt)} | "
                 f"{ratio(sp, rt)} | {fmt(raw.get('e2e_tps'))} | {fmt(bg.get('e2e_tps'))} | "
                 f"{fmt(e.get('e2e_tps'))} | {fmt(e.get('steady_decode_tps'))} | "
                 f"{fmt(r.get('engine_over_bg_median'), 2)} | "
                 f"{fmt(r.get('engine_over_raw_median'), 2)} |")
    for r in results["rows"]:
        diag = [m for m in DIAGNOSTIC if (r.get(m) or {}).get("decode_tps")]
        if diag:
            base = ["raw"] + (["engine"] if (r.get("engine") or {}).get("decode_tps") else [])
            meds = [(f"{x}/{y}", r[f"{x}_over_{y}_median"]) for x, y in PAIRS
                    if x in diag or y in diag if f"{x}_over_{y}_median" in r]
            L.append(f"\nDiagnostic variants, {r['shape']} {r['dtype']} B={r['B']}: "
                     + ", ".join(f"{m} {fmt(r[m]['decode_tps'])}" for m in base + diag)
                     + "".join(f"; {k} median {v:.2f}" for k, v in meds))
    main4 = ("raw", "rawb", "bg", "engine")
    for r in results["rows"]:
        for m in main4:
            x = r.get(m)
            if isinstance(x, dict) and "error" in x:
                L.append(f"\nERROR {(r['shape'], r['dtype'], r['B'], m, x['error'])}")
    bad = [(r["shape"], r["dtype"], r["B"], m) for r in results["rows"] for m in main4
           if isinstance(r.get(m), dict) and r[m].get("ok") is False]
    if bad:
        L.append(f"\nWARNING rows that did not run to max_tokens: {bad}")
    rounds = [r for r in results["rows"] if any(len((r.get(m) or {}).get("all_tps") or [])
                                                 > 1 for m in r["methods"])]
    if rounds:
        L += ["", "Per-round decode tok/s:", "", "| model | B | method | decode tok/s per "
              "round |", "|---|---|---|---|"]
        L += [f"| {r['shape']} {r['dtype']} | {r['B']} | {m} | "
              + ", ".join(fmt(x) for x in r[m]["all_tps"]) + " |"
              for r in rounds for m in r["methods"] if (r.get(m) or {}).get("all_tps")]
    p = results.get("profile")
    if p:
        L += ["", p.get("text") or f"profile ERROR {p.get('error')}"]
    return "\n".join(L) + "\n"


METHODS = ("raw", "rawb", "bg", "engine") + DIAGNOSTIC + tuple(VARIANTS)


def _plan(text: str):
    """--plan's `shape:dtype:B1,B2` entries, space-separated."""
    out = []
    for item in text.split():
        parts = item.split(":")
        if (len(parts) != 3 or parts[0] not in list(common.SHAPES) + ["default"]
                or parts[1] not in common.DTYPES):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not shape:dtype:B1,B2 (as smollm2:bfloat16:1,8; shapes "
                f"{', '.join(common.SHAPES)}, default; dtypes {', '.join(common.DTYPES)})")
        out.append((parts[0], parts[1], common.counts(parts[2])))
    if not out:
        raise argparse.ArgumentTypeError("takes at least one shape:dtype:B1,B2 entry")
    return out


def parse_args(argv, prog):
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shape", default="smollm2", choices=list(common.SHAPES) + ["default"])
    ap.add_argument("--dtype", default="bfloat16", choices=common.DTYPES)
    ap.add_argument("--batch", default=[1, 8, 32, 128], type=common.counts)
    ap.add_argument("--plan", type=_plan, help="space-separated shape:dtype:B1,B2 entries "
                                               "(instead of the three above)")
    ap.add_argument("--prompt", type=common.count, default=64, help="prompt length (tokens)")
    ap.add_argument("--new", type=common.count, default=128, help="new tokens per row")
    ap.add_argument("--warm-new", type=common.count, default=16,
                    help="new tokens in warm-up runs")
    ap.add_argument("--methods", default=["raw", "rawb", "bg", "engine"],
                    type=common.names(METHODS))
    ap.add_argument("--repeat", type=common.count, default=1, help="interleaved rounds per B")
    ap.add_argument("--no-long", action="store_true", help="skip the engine's eng-long run")
    ap.add_argument("--no-fuse", action="store_true", help="Engine(fuse=False)")
    ap.add_argument("--no-warmup", action="store_true", help="Engine(warmup=False)")
    ap.add_argument("--streak-s", type=float, help="Engine(streak_s=...)")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="profile the engine at this batch size (first plan entry)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: past 60%% of it measure once, past it skip what is left")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny shape, seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.profile < 0:
        ap.error("argument --profile: takes a batch size, or 0 for no profile")
    if args.quick:
        common.quick(ap, args, argv, shape="tiny", dtype="float32", batch=[1, 4],
                     prompt=16, new=16, warm_new=4, profile=args.profile or 4)
    return args


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, prog)
    asyncio.run(amain(args, argv))
    return 0


async def amain(args, argv):
    methods = args.methods
    plan = args.plan or [(args.shape, args.dtype, args.batch)]
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# decode  {report.env}")
    results = dict(args=vars(args), rows=[], profile=None)
    rng = np.random.default_rng(1234)
    t_start = pc()

    def over(frac=1.0):
        return args.budget > 0 and pc() - t_start > frac * args.budget

    def save():
        report.write(render(results), results)

    for pi, (shape, dtype, batches) in enumerate(plan):
        if over():
            log(f"## {shape} {dtype}: skipped (--budget)")
            continue
        t = pc()
        model, tok, vocab = common.build_model(shape, dtype)
        twin = (common.build_model(shape, dtype)[0] if not args.no_fuse and (
            args.profile or any(m.startswith("engine") for m in methods)) else model)
        log(f"## {shape} {dtype}: built in {pc() - t:.1f}s; sampling kernels on disk "
            f"after {common.settle_compiles(vocab):.1f} s")
        for B in batches:
            row = dict(shape=shape, dtype=dtype, B=B, prompt=args.prompt, new=args.new,
                       methods=methods)
            warm = common.make_prompts(rng, B, args.prompt, vocab)
            per, errors = {m: [] for m in methods}, {}
            for rep in range(args.repeat):
                if rep and over(0.6):
                    break
                p1 = common.make_prompts(rng, B, args.prompt, vocab)
                p2 = common.make_prompts(rng, B, args.prompt, vocab)
                for meth in common.in_turn(methods, rep):
                    if meth in errors:
                        continue
                    if over():
                        errors[meth] = "skipped: --budget"
                        continue
                    t = pc()
                    try:
                        r = await measure(meth, rep, model, twin, tok, args, B, warm, p1, p2)
                    except Exception as e:
                        traceback.print_exc()
                        errors[meth] = f"{type(e).__name__}: {e}"
                        continue
                    r["took_s"] = pc() - t
                    if not r["ok"]:
                        log(f"  WARNING {meth} B={B}: not every row ran to max_tokens")
                    per[meth].append(r)
                    gc.collect()
                    mx.clear_cache()
            for meth in methods:
                if per[meth]:
                    row[meth] = max(per[meth], key=lambda r: r["decode_tps"])
                    row[meth]["all_tps"] = [r["decode_tps"] for r in per[meth]]
                else:
                    row[meth] = dict(error=errors.get(meth, "no result"), decode_tps=None)
                log(f"  B={B:<4} {meth:<8} " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row[meth].items()))
            for mine, other in PAIRS:
                if mine in per and other in per:
                    rs = [e["decode_tps"] / o["decode_tps"]  # rounds both measured
                          for e, o in zip(per[mine], per[other])
                          if e["decode_tps"] and o["decode_tps"]]
                    if rs:
                        row[f"{mine}_over_{other}_median"] = statistics.median(rs)
            results["rows"].append(row)
            save()
        if args.profile and pi == 0 and not over():
            results["profile"] = await do_profile(model, twin, tok, rng, args, args.profile,
                                                  vocab)
            save()
        del model, twin
        gc.collect()
        mx.clear_cache()
    log("\n" + render(results))
    save()
    if report.path:
        log(f"(written to {report.path})")
