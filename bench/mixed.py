"""Rows joining in waves: aggregate tok/s and time to first token, Engine vs BatchGenerator.

A continuous run (default 64 rows, prompt lengths 16..512, 8 waves 0.2 s apart,
max_batch 64) on the engine and on BatchGenerator driven the same way: aggregate
tok/s, mean / p90 time to first token for all rows and for joiners (waves after the
first), counted from each wave's due time for both (BatchGenerator's loop is
synchronous: a wave due during a step is inserted after it, and that wait counts).
Passes alternate engine, BG, engine, BG (--passes, default 2) on one workload, each
on a fresh Engine / BatchGenerator; the last of each is the measurement: MLX's CUDA
backend sets up kernels per new shape, so a first pass mostly measures that setup.
Every Engine of a process shares one MLX thread, so later passes find kernels warm,
as a notebook that re-creates its engine does. The passes are the process's first
work, so pass 1 is a cold start: with --passes 1, --bg-first and --no-warmup it shows
who pays it. --profile: one more engine pass with per-tick timers (Engine.trace,
Engine(streak_s=0)); --profile-first: timers on the first pass.

  python -m bench mixed --quick
  python -m bench mixed --shape smollm2 --dtype bfloat16 --passes 3 --save
  python -m bench mixed --passes 1 --no-warmup --no-bg     # a cold process, no warm-up
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import time
import traceback

import mlx.core as mx
import numpy as np

import mlxnb
from mlx_lm.generate import BatchGenerator

from . import common
from .common import fmt, log, pc
from .tracing import EngineProfiler, format_mixed_profile

NAME, RESULT, TITLE = "mixed", "engine-mixed", "Mixed workload: tok/s and time to first token"


def workload(rng, rows, waves, lo, hi, vocab):
    lens = rng.integers(lo, hi + 1, size=rows).tolist()
    prompts = [rng.integers(2, vocab, size=n).tolist() for n in lens]
    per = -(-rows // waves)
    return [prompts[w * per:(w + 1) * per] for w in range(waves)]


def ttft_stats(ttfts, joiners):
    def st(xs):
        xs = sorted(xs)
        return dict(n=len(xs), mean_s=statistics.mean(xs), p90_s=common.p90(xs),
                    max_s=xs[-1]) if xs else None
    return dict(all=st(ttfts), joiners=st(joiners))


async def run_engine(model, tok, waves, n, gap, max_batch, kw, prof=None):
    """One pass on a fresh Engine (no warm-up pass of its own: earlier passes warm)."""
    if prof is not None:
        kw = dict(kw, streak_s=0.0)
    t = pc()
    eng = mlxnb.Engine((model, tok), max_batch=max_batch, kv_budget=None, **kw)
    construct_s = pc() - t
    try:
        if prof is not None:
            prof.attach(eng)
        s0 = len(eng.steps)
        t0 = pc()
        rows, late = [], {}
        for w, prompts in enumerate(waves):
            if w:
                await asyncio.sleep(max(0.0, t0 + w * gap - pc()))
            rows.append([eng.submit(common.as_text(p), chat=False, max_tokens=n)
                         for p in prompts])
            for r in rows[-1]:  # TTFT counts from the wave's due time, as for BG
                late[r.id] = pc() - (t0 + w * gap)
        allrows = [r for ws in rows for r in ws]
        res = [await r for r in allrows]
        wall = pc() - t0
        if prof is not None:
            prof.detach(eng)
            prof.mixed = prof.summarize_all(t0, wall)
        steps = eng.steps[s0:]
        return dict(
            tps=sum(len(r.tokens) for r in res) / wall, wall_s=wall,
            tokens=sum(len(r.tokens) for r in res), steps=len(steps),
            ok=all(r.finish_reason == "length" and len(r.tokens) == n for r in res),
            construct_s=construct_s, warmup_s=eng.warmup_s,
            prefill_steps=sum(1 for s in steps if s.prefill_tokens),
            max_batch_seen=max(s.batch_size for s in steps),
            ttft=ttft_stats([r.ttft_s + late[r.id] for r in allrows],
                            [r.ttft_s + late[r.id] for ws in rows[1:] for r in ws]))
    finally:
        await eng.aclose()


def run_bg(model, waves, n, gap, max_batch):
    """One pass on a fresh BatchGenerator, waves inserted between its steps."""
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None,
                         completion_batch_size=max_batch)
    t_ins, t_first, counts, wave_of = {}, {}, {}, {}
    pending, steps, w = set(), 0, 0
    t0 = pc()
    try:
        while True:
            now = pc()
            while w < len(waves) and now >= t0 + w * gap:
                for u in gen.insert(waves[w], [n] * len(waves[w])):
                    t_ins[u], wave_of[u] = t0 + w * gap, w
                    pending.add(u)
                w += 1
            if not pending:
                if w >= len(waves):
                    break
                time.sleep(max(0.0, t0 + w * gap - pc()))
                continue
            _, responses = gen.next()
            steps += 1
            tn = pc()
            for r in responses:
                t_first.setdefault(r.uid, tn)
                counts[r.uid] = counts.get(r.uid, 0) + 1
                if r.finish_reason is not None:
                    pending.discard(r.uid)
    finally:
        gen.close()
    wall = pc() - t0
    tot = sum(counts.values())
    return dict(tps=tot / wall, wall_s=wall, tokens=tot, steps=steps,
                ok=all(counts.get(u) == n for u in t_ins),
                ttft=ttft_stats([t_first[u] - t_ins[u] for u in t_ins],
                                [t_first[u] - t_ins[u] for u in t_ins if wave_of[u] > 0]))


def brief(r):
    if "error" in r:
        return f"ERROR {r['error']}"
    t = r["ttft"]["all"]
    return (f"tok/s={r['tps']:.1f} wall={r['wall_s']:.3f}s steps={r.get('steps')} "
            f"ttft mean={t['mean_s']:.3f}s p90={t['p90_s']:.3f}s ok={r['ok']}"
            + (f" engine construct={r['construct_s']:.3f}s (warm-up {r['warmup_s']:.3f}s)"
               if "construct_s" in r else ""))


async def passes(model, twin, tok, waves, args, save):
    n, mb = args.new, args.max_batch or args.rows
    kw = dict(warmup=not args.no_warmup, fuse=not args.no_fuse)
    if args.streak_s is not None:
        kw["streak_s"] = args.streak_s
    out = dict(passes={})
    kinds = ["engine"] + (["bg"] if not args.no_bg else [])
    if args.bg_first:
        kinds.reverse()
    for p in range(max(1, args.passes)):
        for k in kinds:
            prof = EngineProfiler() if k == "engine" and p == 0 and args.profile_first else None
            try:
                r = (await run_engine(twin, tok, waves, n, args.gap, mb, kw, prof=prof)
                     if k == "engine" else run_bg(model, waves, n, args.gap, mb))
                if prof is not None:
                    out["profile_first"] = dict(prof.mixed, text=format_mixed_profile(
                        prof.mixed, " (pass 1: kernels cold, timers on)"))
            except Exception as e:
                traceback.print_exc()
                r = dict(error=f"{type(e).__name__}: {e}")
            r["pass"] = p + 1
            out["passes"].setdefault(k, []).append(r)
            out[k] = r
            log(f"  {k} pass {p + 1}/{args.passes}: " + brief(r))
            gc.collect()
            mx.clear_cache()
            save(out)
    if args.profile:
        prof = EngineProfiler()
        try:
            r = await run_engine(twin, tok, waves, n, args.gap, mb, kw, prof=prof)
            r["pass"] = "profiled"
            out["passes"]["engine"].append(r)
            log("  engine profiled pass: " + brief(r))
            out["profile"] = dict(prof.mixed, text=format_mixed_profile(
                prof.mixed, f" (pass {args.passes + 1}, timers on; unprofiled pass "
                f"{out['engine'].get('wall_s', 0):.3f} s)"))
            log(out["profile"]["text"])
        except Exception as e:
            traceback.print_exc()
            out["profile"] = dict(error=f"{type(e).__name__}: {e}")
    return out


def render(m, a):
    L = [f"{a.rows} rows, prompts {a.min}...{a.max} tokens, {a.new} new each, {a.waves} "
         f"waves {a.gap} s apart, max_batch {a.max_batch or a.rows} ({a.shape} {a.dtype})",
         "",
         f"Passes alternate (first: {'BG' if a.bg_first else 'engine'}); the last of each "
         "(bold) is the measurement, earlier ones warm the kernels (MLX CUDA compiles per "
         "shape). TTFT counts from each wave's due time (BG's synchronous loop inserts a "
         "wave after the step running when it is due: that wait counts). construct s = "
         "Engine() incl. its warm-up (not in wall or TTFT)"
         + (" -- warm-up off (--no-warmup)." if a.no_warmup else "."), "",
         "| engine | pass | tok/s | wall s | steps | TTFT mean s | TTFT p90 s |"
         " joiners TTFT mean s | joiners TTFT p90 s | ok | construct s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, name in (("engine", "mlxnb"), ("bg", "BatchGenerator")):
        for x in m["passes"].get(k, []):
            if "error" in x:
                L.append(f"| {name} | {x.get('pass')} | ERROR {x['error']} |||||||||")
                continue
            ta, tj = x["ttft"]["all"], x["ttft"]["joiners"] or {}
            b = "**" if x is m.get(k) else ""
            L.append(f"| {name} | {x.get('pass')} | {b}{fmt(x['tps'])}{b} | "
                     f"{x['wall_s']:.2f} | {x.get('steps', '-')} | {ta['mean_s']:.3f} | "
                     f"{ta['p90_s']:.3f} | {tj.get('mean_s', 0):.3f} | "
                     f"{tj.get('p90_s', 0):.3f} | {x['ok']} | "
                     + (f"{x['construct_s']:.2f} |" if "construct_s" in x else "- |"))
    for key in ("profile_first", "profile"):
        if m.get(key):
            L += ["", m[key].get("text") or f"mixed profile ERROR {m[key].get('error')}"]
    return "\n".join(L) + "\n"


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shape", default="smollm2", choices=list(common.SHAPES) + ["default"])
    ap.add_argument("--dtype", default="bfloat16", choices=common.DTYPES)
    ap.add_argument("--rows", type=common.count, default=64)
    ap.add_argument("--waves", type=common.count, default=8)
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between waves")
    ap.add_argument("--min", type=common.count, default=16, help="shortest prompt (tokens)")
    ap.add_argument("--max", type=common.count, default=512, help="longest prompt (tokens)")
    ap.add_argument("--new", type=common.count, default=128, help="new tokens per row")
    ap.add_argument("--max-batch", type=common.count, help="default: --rows")
    ap.add_argument("--passes", type=common.count, default=2,
                    help="alternate engine, BG this many times; the last of each counts")
    ap.add_argument("--no-bg", action="store_true", help="engine passes only")
    ap.add_argument("--bg-first", action="store_true", help="alternate BG, engine, ...")
    ap.add_argument("--no-fuse", action="store_true", help="Engine(fuse=False)")
    ap.add_argument("--no-warmup", action="store_true", help="Engine(warmup=False)")
    ap.add_argument("--streak-s", type=float, help="Engine(streak_s=...)")
    ap.add_argument("--profile", action="store_true",
                    help="one more engine pass with per-tick timers")
    ap.add_argument("--profile-first", action="store_true",
                    help="per-tick timers on the first (cold) engine pass")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny shape, seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        given = common.quick(ap, args, argv, shape="tiny", dtype="float32", new=16, rows=8,
                             waves=4, gap=0.05, min=8, max=64, profile=True)
        if "waves" not in given:  # quick's sizes fit the ones given
            args.waves = min(args.waves, args.rows)
        if "min" not in given:
            args.min = min(args.min, args.max)
    if args.min > args.max:
        ap.error(f"argument --min: takes a prompt length no longer than --max ({args.max}), "
                 f"got {args.min}")
    if args.waves > args.rows:
        ap.error(f"argument --waves: takes at most --rows ({args.rows}) waves, each wave "
                 f"holding a row; got {args.waves}")
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# mixed  {report.env}")
    model, tok, vocab = common.build_model(args.shape, args.dtype)
    twin = model if args.no_fuse else common.build_model(args.shape, args.dtype)[0]
    rng = np.random.default_rng(1234)
    waves = workload(rng, args.rows, args.waves, args.min, args.max, vocab)
    out = asyncio.run(passes(model, twin, tok, waves, args,
                             lambda m: report.write(render(m, args), m)))
    log("\n" + render(out, args))
    report.write(render(out, args), out)
    if report.path:
        log(f"(written to {report.path})")
    return 0
